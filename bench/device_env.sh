# Sourced by the GPU bench scripts, from the repository root on the GPU machine: installs the carried wheels
# (.devcarry/whl*/ and the unpacked ones in .devcarry/whl*.tar.xz, see device_carry.sh), unpacks the carried ComfyUI archive (the newest carried), and points Python
# at this checkout as the package `overdrive` and at that ComfyUI.
wheels=$(ls .devcarry/whl*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels || exit 1; fi
for packed in .devcarry/whl*.tar.xz; do [ -f "$packed" ] && { tar -xJf "$packed" -C /tmp/site || exit 1; }; done
archive=$(ls .devcarry/ComfyUI-*.tar.gz 2>/dev/null | sort -V | tail -1)
if [ -n "$archive" ] && [ ! -f /tmp/ComfyUI/main.py ]; then
  name=$(basename "$archive" .tar.gz)
  tar -xzf "$archive" -C /tmp && rm -rf /tmp/ComfyUI && mv "/tmp/$name" /tmp/ComfyUI || exit 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/overdrive
export PYTHONPATH=/tmp/site:/tmp/pkg COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
# the card's model (h100, h200) for result names: the name's last word is "HBM3" on an H100 SXM
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]+\d+[A-Za-z]*\b', n.replace('NVIDIA', '')); print((m.group(0) if m else n.split()[-1]).lower())" 2>/dev/null || echo cpu)
