#!/usr/bin/env bash
# Device call 1: GPU tests of the merged engine, then decode tok/s before/after the CausalLM runner and HF peers.
export PYTHONPATH=$PWD
S=scripts/gpu_stage.sh
mkdir -p /tmp/h200/records
nvidia-smi --query-gpu=name,memory.total --format=csv | tee /tmp/h200/gpu.txt
git rev-parse HEAD 2>/dev/null > /tmp/h200/commit.txt
bash $S gputests 170 python -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_cuda_graph.py tests/test_engine_llm_engine.py tests/test_engine_model_runner.py tests/test_engine_families.py tests/test_model_ops.py tests/test_kernels_paged_attention.py tests/test_kernels_paged_prefill_attention.py tests/test_kernels_quantized_matmul_stationary.py tests/test_kvcache_quant.py tests/test_quant_weight_only.py
ln -sfn $PWD/data .baseline/data; PYTHONPATH=$PWD/.baseline bash $S decode_before 100 python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --context 512 --max-num-seqs 64 --no-progress --name decode_before --out /tmp/h200/records
bash $S decode_after 300 python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --context 512 --max-num-seqs 64 --no-progress --name decode_after --figures --out /tmp/h200/bench
