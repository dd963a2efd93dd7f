#!/usr/bin/env bash
# Fills .devcarry/ (git-ignored) with what the GPU machine's image lacks for the bench scripts, on this machine (the GPU
# machine reaches no registry): ComfyUI 0.7.0's source archive and wheels for its Python 3.12 on x86-64.
#   bash bench/device_carry.sh
# then carry what the call needs (the repository and the carried paths travel in at most 64 MiB); the bench scripts
# install every carried .devcarry/whl*/ and unpack the archive there:
#   ComfyUI runs (gpu_dit_suite.sh, gpu_compile_suite.sh ...): ComfyUI-0.7.0.tar.gz (4.4 MiB), whl (ComfyUI's
#                  torchsde/trampoline), whl_av (PyAV, 34 MiB: ComfyUI 0.7.0 imports it for Wan's video nodes)
#   gpu_attention.sh: whl_attention (nvidia-cudnn-frontend, sageattention 1.0.6; 11 MiB), whl
#   gpu_dit_suite.sh diffusers-flux: whl_diffusers (diffusers, torchao; 9.3 MiB), no ComfyUI
set -euo pipefail
cd "$(dirname "$0")/.."
download() {  # folder, then requirements
  local folder="$1"; shift
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d ".devcarry/$folder" "$@"
}
mkdir -p .devcarry
cp ../shared/comfyui/ComfyUI-0.7.0.tar.gz .devcarry/
download whl torchsde==0.2.6 trampoline==0.1.2
download whl_attention nvidia-cudnn-frontend==1.32.0 sageattention==1.0.6
download whl_av av==18.1.0
download whl_diffusers diffusers==0.42.1 torchao==0.18.0 importlib_metadata zipp
du -sh .devcarry/*
