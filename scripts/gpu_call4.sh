#!/usr/bin/env bash
# Device call 4: the KV-quant CPU/CUDA test, notebooks 09 and 03 under the gpu profile.
export LABKIT_GIT_COMMIT=84cd86a031c24732fbcfaee363cd43841cfa94f6
bash scripts/gpu_stage.sh kvquant 30 env PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/test_kvcache_quant.py
bash scripts/gpu_call2.sh 09:100 08:110
