#!/usr/bin/env bash
# Device call 3: decode before/after at batch 16 and 64 (engine only, one run), the KV-quant CUDA test, notebook 09.
export PYTHONPATH=$PWD
S=scripts/gpu_stage.sh
mkdir -p /tmp/h200/records
nvidia-smi --query-gpu=name --format=csv | tee /tmp/h200/gpu.txt
ln -sfn $PWD/data .baseline/data
PYTHONPATH=$PWD/.baseline bash $S before_b16_64 80 python -m labkit bench decode --model llama-3-8b --batch 16 64 --context 512 --max-num-seqs 64 --no-hf --no-progress --name decode_before_b16_64 --out /tmp/h200/records
bash $S after_b16_64 80 python -m labkit bench decode --model llama-3-8b --batch 16 64 --context 512 --max-num-seqs 64 --no-hf --no-progress --name decode_after_b16_64 --out /tmp/h200/records
bash $S kvquant 40 python -m pytest -q -x -p no:cacheprovider "tests/test_kvcache_quant.py::test_cuda_cache_stores_what_the_cpu_computes"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
python3 -m ipykernel install --user --name python3 >/dev/null
bash $S nb09 230 python -m labkit run --profile gpu --only 09 --out /tmp/h200/wb09
