#!/usr/bin/env bash
# Fills .devcarry/ (git-ignored) with what the GPU machine's image lacks for the bench scripts, on this machine (the GPU
# machine reaches no registry): ComfyUI's source archive and wheels for its Python 3.12 on x86-64.
#   bash bench/device_carry.sh            (COMFY_VERSION=0.7.0 for the older ComfyUI)
# then carry what the call needs (the repository and the carried paths travel in at most 64 MiB); the bench scripts
# install every carried .devcarry/whl*/ and unpack the archive there:
#   ComfyUI runs (gpu_dit_suite.sh, gpu_dynamic_vram.sh ...): ComfyUI-0.33.0.tar.gz (1.9 MiB), whl (ComfyUI's
#                  torchsde/trampoline and comfy-aimdo, dynamic VRAM), whl_kitchen (comfy-kitchen, 0.33's quantized
#                  layers and attention, 45 MiB: without the ROCm library a CUDA machine never loads)
#   whl_av (PyAV, 34 MiB): only for ComfyUI's V3 nodes' modules (EasyCache, video nodes); carried apart
#   whl_cudnn (nvidia-cudnn-frontend alone, 11 MiB): the cuDNN fp8 attention backend beside a ComfyUI run
#   whl_fa3 (fa3-fwd, FlashAttention-3's forward, 27 MiB): the attention chooser's 16-bit Hopper kernel
#   whl_kitchen.tar.xz, whl_fa3.tar.xz, whl_cudnn.tar.xz, whl_av.tar.xz: the same wheels unpacked and xz-compressed
#                  (21, 9, 6 and 19 MiB; PyAV's modules without their debug information); device_env.sh unpacks
#                  them. Overdrive's V3 nodes import ComfyUI's comfy_api, which imports PyAV, so every ComfyUI run
#                  carries whl_av.tar.xz; with the archive, whl, whl_kitchen and the repository, both whl_fa3 and
#                  whl_cudnn fit under the 64 MiB of a call
#   whl_sage (sageattention 1.0.6, Triton kernels, 20 KiB): ComfyUI's --use-sage-attention peer (gpu_fa3_ab.sh)
#   The repository travels too: its learned reference models (builtin_models/learned/, 33 MiB) and a ComfyUI run's
#                  carry (41 MiB) exceed a call's 64 MiB together. A call that does not sample them (every gpu_*.sh
#                  but gpu_train_learned.sh and bench_fidelity.py) runs with those files moved out of the checkout;
#                  one that samples one model keeps only that model's two files.
#   gpu_attention.sh: whl_attention (nvidia-cudnn-frontend, sageattention 1.0.6; 11 MiB), whl
#   gpu_dit_suite.sh diffusers-flux: whl_diffusers (diffusers, torchao; 9.3 MiB), no ComfyUI
set -euo pipefail
cd "$(dirname "$0")/.."
version="${COMFY_VERSION:-0.33.0}"
download() {  # folder, then requirements
  local folder="$1"; shift
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d ".devcarry/$folder" "$@"
}
mkdir -p .devcarry
# The source less what no bench or GPU test imports (its tests, workflow blueprints, API nodes, tokenizer data), so
# that the archive, comfy-kitchen and cuDNN's frontend travel together: 1.9 MiB instead of 7.3.
unpacked=$(mktemp -d) && tar -xzf "../shared/comfyui/ComfyUI-$version.tar.gz" -C "$unpacked"
tar -czf ".devcarry/ComfyUI-$version.tar.gz" -C "$unpacked" --exclude="ComfyUI-$version/tests" \
  --exclude="ComfyUI-$version/tests-unit" --exclude="ComfyUI-$version/blueprints" \
  --exclude="ComfyUI-$version/comfy_api_nodes" --exclude="ComfyUI-$version/comfy/text_encoders/*/*" \
  --exclude="ComfyUI-$version/comfy/sd1_tokenizer/*" "ComfyUI-$version" && rm -rf "$unpacked"
download whl torchsde==0.2.6 trampoline==0.1.2 comfy-aimdo==0.4.13
if [ "$version" != "0.7.0" ]; then  # repacked without its ROCm library, at zip's highest compression
  download kitchen_wheel comfy-kitchen==0.2.31
  wheel=$(ls .devcarry/kitchen_wheel/comfy_kitchen-*.whl); unpacked=$(mktemp -d)
  unzip -q "$wheel" -x 'comfy_kitchen/backends/hip/*' -d "$unpacked"
  rm -rf .devcarry/whl_kitchen && mkdir -p .devcarry/whl_kitchen
  (cd "$unpacked" && zip -q -9 -r "$OLDPWD/.devcarry/whl_kitchen/$(basename "$wheel")" .)
  rm -rf .devcarry/kitchen_wheel "$unpacked"
fi
download whl_av av==18.1.0
download whl_attention nvidia-cudnn-frontend==1.32.0 sageattention==1.0.6
mkdir -p .devcarry/whl_cudnn .devcarry/whl_sage && cp .devcarry/whl_attention/nvidia_cudnn_frontend-* .devcarry/whl_cudnn/
cp .devcarry/whl_attention/sageattention-* .devcarry/whl_sage/
download whl_diffusers diffusers==0.42.1 torchao==0.18.0 importlib_metadata zipp
download whl_fa3 fa3-fwd==0.0.3
for folder in whl_kitchen whl_fa3 whl_cudnn whl_av; do  # zip's deflate leaves CUDA binaries twice xz's size
  unpacked=$(mktemp -d) && for wheel in .devcarry/$folder/*.whl; do unzip -q -o "$wheel" -d "$unpacked"; done
  # PyAV's 49 extension modules ship their debug information (25 of its 31 MiB): without it every carried wheel
  # travels together in one call
  [ "$folder" = whl_av ] && find "$unpacked/av" -name "*.so" -exec strip --strip-debug {} +
  tar -cf - -C "$unpacked" . | xz -9 -T0 > ".devcarry/$folder.tar.xz" && rm -rf "$unpacked"
done
du -sh .devcarry/*
