#!/usr/bin/env bash
# Device call 4: the KV-quant CPU/CUDA test, notebooks 09 and 03 under the gpu profile.
export LABKIT_GIT_COMMIT=1dc4cda4151232fff975e0d6c722904ca5c4b177
bash scripts/gpu_stage.sh kvquant 40 env PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/test_kvcache_quant.py
bash scripts/gpu_call2.sh 09:130 03:250
