#!/usr/bin/env bash
# Run one stage of the H200 batch: STAGE NAME, TIMEOUT seconds, then the command; tars /tmp/h200 into $OUT/NAME.tgz.
# Used by the lead's device calls so that a stage that overruns still returns what the earlier ones wrote.
name=$1; limit=$2; shift 2
echo "=== $name (limit ${limit}s): $*"
start=$(date +%s)
timeout "$limit" "$@" 2>&1 | grep -v -E "WARNING|it/s\]|s/it\]|USDT" | tail -25
echo "=== $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - start ))s"
tar czf "$OUT/$name.tgz" -C /tmp h200 2>/dev/null
