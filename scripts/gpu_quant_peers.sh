#!/usr/bin/env bash
# One device call of under eight minutes: quantisation at serving batches, labkit's kernels against the peers.
#   prepare (here):  ../shared/tools/gpu-wheels.sh .whl-peers peers        # torchao, gemlite, liger-kernel wheels
#   run (device):    LABKIT_GIT_COMMIT=<sha of HEAD> bash scripts/gpu_quant_peers.sh [STAGE ...]   (carry: .whl-peers)
#   STAGE: gemm, decode, figures (default: all three, in that order; decode uses the table gemm wrote in this call
#   or, without one, labkit's own kernels)
# Stages, each with a hard limit, each leaving its records if a later one fails (logs in $OUT/quant/logs):
#   gemm     scripts/quant_peers.py gemm: every path of every format on one 8B and one 175B layer at 1-256 rows
#            (built and checked within a budget, cheapest first, then timed within another; the record is rewritten
#            after every batch) -> records/format_gemm.json, records/quant_dispatch.json (the engine's kernel table)
#   decode   bench decode --formats bf16 int4 fp8 int8 at batch 1, 16, 64 through the engine, each layer on the
#            kernel the table measured fastest at its batch -> records/quant_decode.json
#   figures  scripts/quant_peers.py figures: quant.<fmt>_* and plan.gpus_175b_<w>* -> figures.json, records/quant_plan.json
# Afterwards (here): copy $OUT/quant/records/*.json to results/<gpu>/records/, then
#   python -m labkit merge <fetched>/quant results/<gpu> && python -m labkit claims && python -m labkit readme
set -u
start=$(date +%s)
Q=${OUT:?OUT must name the folder whose files come back}/quant
mkdir -p "$Q/logs" "$Q/records"
STAGE_LOGS="$Q/logs"
source "$(dirname "$0")/stage.sh"
# compiled kernels and autotune results seeded from research/records/<gpu>/ and packed into $OUT at the end
# (commit $OUT/compiled_kernels.tar.xz and $OUT/triton_autotune.tgz there): scripts/triton_autotune.sh
source "$(dirname "$0")/triton_autotune.sh"
autotune_seed
kernel_cache_seed
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$Q/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-peers/*.whl \
  2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY' 2>&1 | grep -v -E "Warning|Failed to load|^W[0-9]{4}" | tee "$Q/peers.txt"
import importlib
for name in ("torchao", "gemlite", "liger_kernel"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # recorded by the measurement as each path's status too
        print(name, "not importable:", type(e).__name__, str(e)[:200])
PY
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(gemm decode figures)
for st in "${stages[@]}"; do
  case $st in
    gemm) stage gemm 260 python3 scripts/quant_peers.py gemm --out "$Q" --budget 110 --timing 50 --budget-175b 25 \
            --timing-175b 30 ;;
    decode) table=labkit
      [ -f "$Q/records/quant_dispatch.json" ] && table="$Q/records/quant_dispatch.json"
      stage decode 150 python3 -m labkit bench decode --model llama-3-8b --batch 1 16 64 --context 512 --steps 16 \
        --formats bf16 int4 fp8 int8 --no-hf --dispatch "$table" --name quant_decode --out "$Q" --no-progress ;;
    figures) stage figures 40 python3 scripts/quant_peers.py figures --out "$Q" ;;
    *) echo "unknown stage: $st (gemm, decode, figures)" >&2; exit 2 ;;
  esac
done
kernel_cache_pack "$OUT/compiled_kernels.tar.xz"
autotune_pack "$OUT/triton_autotune.tgz"
echo "=== done at $(( $(date +%s) - start ))s"
ls -la "$Q" "$Q/records"
