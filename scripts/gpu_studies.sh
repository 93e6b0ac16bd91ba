#!/usr/bin/env bash
# The engine's decode step (issue 42's figures, sync and async, attributed), where an async step's time goes, and the
# two kernel ladders of issue 42's items 2 and 3: `decode timeline` fit one device call (limits 330 + 150 s), `kvq
# flash` another (117 s on an H100 at 0518b54).
#   run (device):  LABKIT_GIT_COMMIT=<sha of HEAD> bash scripts/gpu_studies.sh [STAGE ...]   (no wheels needed)
#   STAGE: decode, timeline, kvq, flash (default: these four, in this order); ncu (research/kv_attn_ncu.py: Nsight
#   Compute's counters of the bf16, int8 and fp8 decode-attention kernels), swap (research/kv_attn_operand_order.py:
#   the decode kernel with the cache tile as the MMA's first operand)
# bench decode writes its record after each row: batch 64 first, the row issue 42's bars are read from, so a stage cut
# at its limit keeps it (its figures are then made here from the record). Each stage has a hard limit and writes
# under $OUT/studies (logs/, bench/, async_timeline.json, kvq.json, flash.json), so a stage killed at its limit leaves
# what the earlier ones wrote. Afterwards (here): copy the records to
# research/records/<gpu>/ (the ladders) and results/<gpu>/records/ (bench/records/bench_decode.json), then
# python -m labkit merge <fetched>/studies/bench results/<gpu> && python -m labkit claims && python -m labkit readme
set -u
start=$(date +%s)
S=${OUT:?OUT must name the folder whose files come back}/studies
mkdir -p "$S/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STAGE_LOGS="$S/logs"
source "$(dirname "$0")/stage.sh"
# compiled kernels and autotune results seeded from research/records/<gpu>/ and packed into $OUT at the end
# (commit $OUT/compiled_kernels.tar.xz and $OUT/triton_autotune.tgz there): scripts/triton_autotune.sh
source "$(dirname "$0")/triton_autotune.sh"
autotune_seed
kernel_cache_seed
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$S/gpu.txt"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(decode timeline kvq flash)
for st in "${stages[@]}"; do
  case $st in
    decode) stage decode 330 python3 -m labkit bench decode --model llama-3-8b --batch 64 1 16 --context 512 \
              --max-num-seqs 64 --async-scheduling both --profile --figures --no-progress --out "$S/bench" ;;
    timeline) stage timeline 150 python3 research/async_timeline.py --out "$S/async_timeline.json" ;;
    ncu) stage ncu 150 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
           --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --csv \
           --log-file "$S/kv_attn_ncu.csv" python3 research/kv_attn_ncu.py ;;
    kvq) stage kvq 120 python3 research/kv_quant_decode_study.py --out "$S/kvq.json" ;;
    swap) stage swap 150 python3 research/kv_attn_operand_order.py --out "$S/kv_swap.json" ;;
    flash) stage flash 150 python3 research/flash_prefill_study.py --out "$S/flash.json" ;;
    *) echo "unknown stage: $st (decode, timeline, kvq, flash, ncu, swap)" >&2; exit 2 ;;
  esac
done
kernel_cache_pack "$OUT/compiled_kernels.tar.xz"
autotune_pack "$OUT/triton_autotune.tgz"
echo "=== done at $(( $(date +%s) - start ))s"
