#!/usr/bin/env bash
# Sourced by the device-call scripts: `stage NAME LIMIT CMD...` runs CMD under a hard limit of LIMIT seconds, its
# whole log in $STAGE_LOGS/NAME.log (written as it runs, so a stage killed at its limit keeps it), prints the log's
# tail without progress bars and warnings, and the return code with the seconds since $start.
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) at $(( $(date +%s) - start ))s: $*"
  PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" > "$STAGE_LOGS/$name.log" 2>&1
  local rc=$?
  grep -v -E "Warning|warn\(|it/s\]|s/it\]|Failed to load|^W[0-9]{4}" "$STAGE_LOGS/$name.log" | tail -40
  echo "=== $name rc=$rc at $(( $(date +%s) - start ))s"
}
