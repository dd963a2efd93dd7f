#!/usr/bin/env bash
# One device call: CompileModel / CompileVAE against eager and the peer (SD1.5 512², SDXL 1024²), then restart + switch.
# Usage on the GPU machine, from the repository root: bash bench/gpu_compile_suite.sh "$OUT"
set -uo pipefail
out="${1:-bench/results}"; day=$(date +%F)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())" 2>/dev/null || echo cpu)
cd bench
python3 bench_compile.py --arch sd15 --res 512 --variants eager,peer,overdrive,overdrive-no-cudagraphs --repeats 5 \
  --out "$out/${day}_${gpu}_sd15_compile.json" 2>&1 | grep -v "^W1\|Warning" | tail -8
python3 bench_compile.py --arch sdxl --res 1024 --variants eager,peer,overdrive --vae \
  --out "$out/${day}_${gpu}_sdxl_compile.json" 2>&1 | grep -v "^W1\|Warning" | tail -10
