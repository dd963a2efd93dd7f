#!/usr/bin/env bash
# GPU calls for QuantizeModel and DeepCache, composed with CompileModel, against eager (same process, same seed).
# Usage on the GPU machine, from the repository root: bash bench/gpu_compose_suite.sh PART "$OUT"
#   PART: quant-sdxl | deepcache-sdxl | sd15 | gemm
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
cd bench
filter() { grep -v "^W1\|Warning\|warn(" | tail -"$1"; }
case "$part" in
  quant-sdxl)
    python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --variants eager,overdrive,overdrive+int8,overdrive+fp8 \
      --out "$out/${day}_h100_sdxl_quantize.json" 2>&1 | filter 14 ;;
  deepcache-sdxl)
    python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --repeats 2 \
      --variants eager,deepcache,overdrive,overdrive+deepcache \
      --out "$out/${day}_h100_sdxl_deepcache.json" > "$out/deepcache_sdxl.log" 2>&1; filter 12 < "$out/deepcache_sdxl.log" ;;
  sd15)
    python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 5 \
      --variants eager,overdrive,deepcache,overdrive+deepcache --cprofile \
      --out "$out/${day}_h100_sd15_deepcache.json" > "$out/deepcache_sd15.log" 2>&1; filter 45 < "$out/deepcache_sd15.log" ;;
  gemm)
    python3 bench_quantize.py --out "$out/${day}_h100_quantize_gemm.json" 2>&1 | filter 30 ;;
esac
