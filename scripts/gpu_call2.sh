#!/usr/bin/env bash
# Device call 2: notebooks under the gpu profile (papermill from the carried wheels), each a stage with its limit.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
python3 -m ipykernel install --user --name python3 >/dev/null
S=scripts/gpu_stage.sh
mkdir -p /tmp/h200
nvidia-smi --query-gpu=name,memory.total --format=csv | tee /tmp/h200/gpu.txt
for nb in "$@"; do
  id=${nb%%:*}; limit=${nb##*:}
  bash $S nb$id "$limit" python -m labkit run --profile gpu --only "$id" --out /tmp/h200/wb$id
done
