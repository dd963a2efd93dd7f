#!/usr/bin/env bash
# Attention kernels and whole-model runs with 8-bit attention, on the GPU machine, from the repository root:
#   [SWEEP=1] [SHAPES=a,b] bash bench/gpu_attention.sh kernels "$OUT"   # bench/attention_kernels.py
# The wheels the machine's image lacks (nvidia-cudnn-frontend, sageattention 1.0.6, ComfyUI's torchsde/trampoline)
# travel in .devcarry/whl.
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())" 2>/dev/null || echo cpu)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/overdrive
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
case "$part" in
  kernels) python3 bench/attention_kernels.py ${SWEEP:+--sweep} ${SHAPES:+--shapes $SHAPES} \
             --out "$out/${day}_${gpu}_attention_kernels.json" 2>&1 | grep -v "^W1\|warn" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
