#!/usr/bin/env bash
# Device call 5: the engine's CUDA-graph pool at batch 64 (and the decode figures) with the fixed measurement.
export LABKIT_GIT_COMMIT=c0673115a90b6cfd0c5d9a63fb43417b2ef2dfb5 PYTHONPATH=$PWD
mkdir -p /tmp/h200
bash scripts/gpu_stage.sh pool64 100 python -m labkit bench decode --model llama-3-8b --batch 64 --context 512 --max-num-seqs 64 --no-hf --no-progress --name decode_pool_b64 --figures --out /tmp/h200/bench
