#!/usr/bin/env bash
# Run one stage of an H200 batch: NAME, LIMIT seconds, then the command.
# The stage's whole log goes to /tmp/h200/logs/NAME.log as it is written (so a stage killed at its limit still
# leaves its log), and after the stage /tmp/h200 is packed into $OUT/h200.tgz (one file back, whatever the number
# of stages). Papermill starts its kernels in a session of their own, so `timeout` alone leaves them running on the
# GPU, competing with the next stage: every ipykernel is killed after each stage.
name=$1; limit=$2; shift 2
mkdir -p /tmp/h200/logs
log=/tmp/h200/logs/$name.log
echo "=== $name (limit ${limit}s): $*" | tee "$log"
start=$(date +%s)
PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" >>"$log" 2>&1
rc=$?
pkill -9 -f ipykernel_launcher 2>/dev/null
grep -v -E "WARNING|it/s\]|s/it\]|USDT" "$log" | tail -15
echo "=== $name rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$log"
tar czf "$OUT/h200.tgz" --exclude="*trace*.json" -C /tmp h200 2>/dev/null
