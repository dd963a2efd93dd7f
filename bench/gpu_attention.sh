#!/usr/bin/env bash
# Attention kernels and whole-model runs with 8-bit attention, on the GPU machine, from the repository root:
#   [SWEEP=1] [SHAPES=a,b] bash bench/gpu_attention.sh kernels "$OUT"   # bench/attention_kernels.py
#   bash bench/gpu_attention.sh gemv "$OUT"   # bench/probes/quantize_gemv.py: the weight-only int8 kernel
#   bash bench/gpu_attention.sh norm "$OUT"   # bench/probes/norm_epilogue.py: the blocks' layer-norm kernel
#   [SHAPES=a,b] [MLP_VARIANTS=a,b] bash bench/gpu_attention.sh mlp "$OUT"   # bench/probes/fp8_mlp_autotune.py: the fp8 MLP,
#                                                                                    compiled by default and with max-autotune
#   bash bench/gpu_attention.sh gelu "$OUT"   # bench/probes/fp8_gelu_gemm.py: the fp8 MLP's first GEMM with GELU, two ways
# The wheels the machine's image lacks travel in .devcarry/whl_attention (nvidia-cudnn-frontend, sageattention
# 1.0.6) and whl (bench/device_carry.sh makes them).
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
source bench/device_env.sh
case "$part" in
  kernels) python3 bench/attention_kernels.py ${SWEEP:+--sweep} ${SHAPES:+--shapes $SHAPES} \
             --out "$out/${day}_${gpu}_attention_kernels.json" 2>&1 | grep -v "^W1\|warn" ;;
  gemv) python3 bench/probes/quantize_gemv.py --out "$out/${day}_${gpu}_quantize_gemv.json" 2>&1 | grep -v "^W1\|warn" ;;
  norm) python3 bench/probes/norm_epilogue.py --out "$out/${day}_${gpu}_norm_epilogue.json" 2>&1 | grep -v "^W1\|warn" ;;
  mlp) python3 bench/probes/fp8_mlp_autotune.py ${SHAPES:+--shapes $SHAPES} ${MLP_VARIANTS:+--variants $MLP_VARIANTS} \
         --out "$out/${day}_${gpu}_fp8_mlp_autotune.json" 2>&1 | grep -v "^W1\|warn" ;;
  gelu) python3 bench/probes/fp8_gelu_gemm.py --out "$out/${day}_${gpu}_fp8_gelu_gemm.json" 2>&1 | grep -v "^W1\|warn" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
