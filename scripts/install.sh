#!/usr/bin/env bash
# Sets up a fresh machine for Overdrive: torch, ComfyUI 0.33.0 with its own requirements, Overdrive's.
#   --tests                        also what only the test suite uses: requirements-dev.txt and, as root on Debian,
#                                  redis-server and chromium
#   COMFYUI_PATH=/path/to/ComfyUI  use that ComfyUI (>= 0.33.0) instead of setting one up (Overdrive is linked into it)
#   OVERDRIVE_NO_SYSTEM_PACKAGES=1 skip those Debian packages even with --tests
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
comfy_version="0.33.0"     # what a fresh machine gets
comfy_commit="783545f6"     # upstream master at 0.33.0 (no release tag)
pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }
tests=""
case "${1:-}" in
  --tests) tests=1 ;;
  "") ;;
  *) echo "usage: bash scripts/install.sh [--tests]" >&2; exit 2 ;;
esac

# 1. torch: keep the one a user already has; on a fresh machine take the pinned build.
if ! "$py" -c "import torch, torchvision" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
fi
pip_install -r "requirements${tests:+-dev}.txt"

# 2. With --tests, the Debian packages that only the tests start for real: a Redis server (shared compile cache of a
#    fleet) and Chromium (the drag-and-drop browser test). Installed where missing and where apt-get can (root on Debian).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || missing+=(chromium chromium-driver)
if [ -n "$tests" ] && [ ${#missing[@]} -gt 0 ] && [ -z "${OVERDRIVE_NO_SYSTEM_PACKAGES:-}" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "Installing system packages for the tests: ${missing[*]} (OVERDRIVE_NO_SYSTEM_PACKAGES=1 skips this)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "Install these system packages for the full test suite: ${missing[*]}" >&2
  fi
fi

# 3. ComfyUI. Not on PyPI: COMFYUI_PATH, else the source archive beside the repository (../shared/comfyui), else a
#    shallow clone of the release tag.
if [ -z "${COMFYUI_PATH:-}" ]; then
  COMFYUI_PATH="$repo/.comfyui/ComfyUI"
  if ! grep -qs "\"$comfy_version\"" "$COMFYUI_PATH/comfyui_version.py"; then
    rm -rf "$COMFYUI_PATH" && mkdir -p "$repo/.comfyui"
    archive="$repo/../shared/comfyui/ComfyUI-$comfy_version.tar.gz"
    if [ -f "$archive" ]; then
      tar -xzf "$archive" -C "$repo/.comfyui" && mv "$repo/.comfyui/ComfyUI-$comfy_version" "$COMFYUI_PATH"
    else
      { git clone -q https://github.com/comfyanonymous/ComfyUI "$COMFYUI_PATH" &&
        git -C "$COMFYUI_PATH" checkout -q "$comfy_commit"; } || {
        echo "Could not download ComfyUI $comfy_version from GitHub. Set COMFYUI_PATH to your ComfyUI (>= 0.33.0), or put" \
             "ComfyUI-$comfy_version.tar.gz in $(cd "$repo/.." && pwd)/shared/comfyui/, and run this again." >&2
        exit 1
      }
    fi
  fi
fi
[ -f "$COMFYUI_PATH/main.py" ] || { echo "COMFYUI_PATH=$COMFYUI_PATH has no main.py" >&2; exit 1; }

# ComfyUI's own requirements, with the installed torch held as it is. A requirement that cannot install here is
# named, and the rest still install.
constraints="$(mktemp)"
"$py" - >"$constraints" <<'PY'
import torch, torchvision
print(f"torch=={torch.__version__.split('+')[0]}\ntorchvision=={torchvision.__version__.split('+')[0]}")
PY
requirements="$(mktemp)"
grep -v -E '^\s*(#|$|torchaudio)' "$COMFYUI_PATH/requirements.txt" >"$requirements" || true  # none left: fine
echo "requests" >>"$requirements"   # ComfyUI 0.7 imports it without listing it
if ! pip_install -r "$requirements" -c "$constraints" 2>/dev/null; then
  while read -r requirement; do
    pip_install "$requirement" -c "$constraints" 2>/dev/null ||
      echo "WARNING: ComfyUI's requirement '$requirement' does not install here; ComfyUI runs without it." >&2
  done <"$requirements"
fi
rm -f "$constraints" "$requirements"

# torchaudio: ComfyUI 0.33's comfy/sd.py imports it. Its build for the installed torch where PyPI has one, else the
# newest build that imports beside it (installed without its torch pin: torchaudio's Python API is what ComfyUI uses).
if ! "$py" -c "import torchaudio" 2>/dev/null; then
  torch_minor="$("$py" -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))")"
  pip_install --no-deps "torchaudio==${torch_minor}.*" 2>/dev/null ||
    pip_install --no-deps "torchaudio==${TORCHAUDIO_FALLBACK_VERSION:-2.11.0}" ||
    echo "WARNING: torchaudio does not install here; ComfyUI 0.33 cannot load models without it." >&2
  "$py" -c "import torchaudio" 2>/dev/null || echo "WARNING: torchaudio is installed but does not import." >&2
fi

# 4. On a Hopper or newer NVIDIA GPU: NVIDIA's cuDNN frontend, for the 8-bit attention's cuDNN fp8 backend (chosen by
#    default on Flux, Qwen-Image, Wan 2.2 and Z-Image, bench/EXPERIMENTS.md). Without its declared dependencies
#    (CUTLASS's DSL, TVM FFI: hundreds of MB this graph does not use); without it that backend is simply not offered.
hopper='import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)))'
if "$py" -c "$hopper" 2>/dev/null && ! "$py" -c "import cudnn" 2>/dev/null; then
  pip_install --no-deps "nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION:-1.32.0}" ||
    echo "WARNING: nvidia-cudnn-frontend does not install here; 8-bit attention keeps its Triton backend." >&2
fi
# ... and on Hopper itself (its kernels are sm_90a): FlashAttention-3's forward kernel (`fa3-fwd`, prebuilt, no
# compiler at run time), a 16-bit backend of the attention chooser. Its declared dependencies are build tools it does
# not import; without it the chooser times SDPA's kernels only.
hopper_only='import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9))'
if "$py" -c "$hopper_only" 2>/dev/null && ! "$py" -c "import fa3_fwd_interface" 2>/dev/null; then
  pip_install --no-deps "fa3-fwd==${FA3_FWD_VERSION:-0.0.3}" ||
    echo "WARNING: fa3-fwd does not install here; attention keeps SDPA's kernels." >&2
fi

# 5. Overdrive as a custom node of that ComfyUI, and as the importable package `overdrive`.
link="$COMFYUI_PATH/custom_nodes/overdrive"
if [ ! -e "$link" ]; then ln -s "$repo" "$link"; fi
pip_install --no-deps --no-build-isolation -e .
installed_version="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFYUI_PATH/comfyui_version.py" 2>/dev/null)"
if [ -n "$installed_version" ] &&
   [ "$(printf '%s\n%s\n' "$comfy_version" "$installed_version" | sort -V | head -1)" != "$comfy_version" ]; then
  echo "WARNING: ComfyUI $installed_version at $COMFYUI_PATH is older than $comfy_version, the oldest Overdrive is" \
       "tested on; update it (git pull in that folder) if a node fails." >&2
fi
echo "Overdrive is set up: ComfyUI ${installed_version:-of unknown version} at $COMFYUI_PATH"
