#!/usr/bin/env bash
# The gpu profile, checked in stages that each fit a device call: the GPU tests and every notebook.
#   scripts/gpu_check.sh [STAGE[:LIMIT_S] ...]     STAGE: tests, or a notebook number 00..09; default: all of them
# (PROFILE=ci runs the notebooks under the ci profile: a dry run of the script on a CPU)
# Each stage runs under its own time limit (default 300 s, tests 420 s), its log written as it runs, and the check
# carries on past a failure. After each stage one row goes to $OUT/gpu_check.json (python -m labkit gpu-check
# record) and the run's folder (executed notebooks, records, figures.json, logs) is packed into $OUT/gpu_run.tgz,
# so a call killed at its limit still returns what finished. Merge the rows of several calls with
#   python -m labkit gpu-check table ROWS.json... --write results/<gpu>/gpu_check.json
# Papermill starts its kernels in a session of their own: every ipykernel is killed after each stage.
# Triton's autotuning results are seeded from research/records/<gpu>/triton_autotune.tgz and packed after each stage
# into $OUT/triton_autotune.tgz (scripts/triton_autotune.sh): commit that file there for the next machine. The
# compiled kernels (Triton's and torch.compile's) are seeded from research/records/<gpu>/compiled_kernels.tar.xz
# and packed into $OUT/compiled_kernels.tar.xz after the last stage: commit that file there too; each row records
# which state the run started from.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
RUN=${LABKIT_GPU_RUN:-/tmp/gpu_run}
mkdir -p "$OUT" "$RUN/logs"
source "$(dirname "$0")/triton_autotune.sh"
autotune_seed
kernel_cache_seed
# every stage of this call is one run (one machine, one commit): a claim comparing figures of two notebooks (05's
# engine against 00's HF baseline, 06's plan against 08's) is checked only on figures of one run
export LABKIT_RUN_ID=${LABKIT_RUN_ID:-$(python3 -c "from labkit.bench import new_run_id; print(new_run_id())")}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests 00 01 02 03 04 05 06 07 08 09)
for st in "${stages[@]}"; do
  name=${st%%:*}
  limit=${st#*:}
  if [ "$limit" = "$st" ]; then
    if [ "$name" = tests ]; then limit=420; else limit=300; fi
  fi
  log=$RUN/logs/$name.log
  [ -f "$RUN/figures.json" ] && cp "$RUN/figures.json" "$RUN/figures.before.json" || echo '{}' > "$RUN/figures.before.json"
  echo "=== $name (limit ${limit}s)" | tee "$log"
  start=$(date +%s)
  if [ "$name" = tests ]; then
    # with pytest-xdist, files run on GPU_TEST_WORKERS processes at once: most of a GPU test's time is Triton
    # compiling its kernels on the host (one process: 291 s for 92 tests on an H100), and the GPU has room for four
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-4}" --dist loadfile)
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider "${workers[@]}" \
      >>"$log" 2>&1
  else
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" python3 -m labkit run --profile "${PROFILE:-gpu}" --only "$name" --out "$RUN" \
      >>"$log" 2>&1
  fi
  rc=$?
  pkill -9 -f ipykernel_launcher 2>/dev/null
  grep -v -E "WARNING|it/s\]|s/it\]|USDT" "$log" | tail -6
  python3 -m labkit gpu-check record --stage "$name" --rc "$rc" --seconds "$(( $(date +%s) - start ))" \
    --log "$log" --run "$RUN" --out "$OUT/gpu_check.json" --before "$RUN/figures.before.json"
  tar czf "$OUT/gpu_run.tgz" --exclude="*trace*.json" --exclude="figures.before.json" -C "$(dirname "$RUN")" \
    "$(basename "$RUN")" 2>/dev/null
  autotune_pack "$OUT/triton_autotune.tgz"
done
# once, after the last stage: Inductor's cache can run to hundreds of MB before the IR is left out, too much to
# pack after every stage (a call killed before this line returns no compiled kernels; the next starts from the seed)
kernel_cache_pack "$OUT/compiled_kernels.tar.xz"
python3 -m labkit gpu-check table "$OUT/gpu_check.json"
