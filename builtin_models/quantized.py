"""Built-in diffusion-model files in the quantized layouts users download today, made from the family's built-in bf16
file with ComfyUI's own fp8 layout class (comfy.quant_ops.TensorCoreFP8E4M3Layout), and read back by ComfyUI's loader
as it reads the released files (comfy/utils.py convert_old_quants, comfy.ops.mixed_precision_ops):

- "fp8_scaled" (Wan 2.2's `*_fp8_scaled`, the older convention): every block linear's weight in e4m3 with a
  `<layer>.scale_weight`, and a `scaled_fp8` marker tensor;
- "fp8_mixed" (Flux.2's `flux2_dev_fp8mixed`, Qwen-Image's `_fp8_hq`): the block linears but their modulation layers
  in e4m3 with a `<layer>.weight_scale`, listed per layer in the file's `_quantization_metadata`; the rest in bf16.
"""
from __future__ import annotations

import json
import pathlib
import re

import torch

from .dit import MODULATION, ensure_diffusion_model

LAYOUTS = ("fp8_scaled", "fp8_mixed")
BLOCK_LINEAR = re.compile(r"(^|\.)(blocks|double_blocks|single_blocks|transformer_blocks|layers|joint_blocks)\.\d+\.")
FP8_FORMAT = "float8_e4m3fn"


def _quantized_layers(state: dict, layout: str) -> list:
    """The layers (key without `.weight`) a file of `layout` stores in e4m3: 2-D block weights both of whose sides are
    multiples of 16 (the fp8 GEMMs' rule); "fp8_mixed" leaves the modulation layers in bf16."""
    layers = []
    for key, tensor in state.items():
        match = BLOCK_LINEAR.search(key)
        if not key.endswith(".weight") or tensor.dim() != 2 or match is None:
            continue
        if tensor.shape[0] % 16 or tensor.shape[1] % 16 or (layout == "fp8_mixed" and MODULATION.search(key)):
            continue
        layers.append(key[: -len(".weight")])
    return layers


def quantized_state(state: dict, layout: str) -> tuple:
    """(tensors, metadata) of `state` (a bf16 diffusion model) in `layout`."""
    from comfy.quant_ops import TensorCoreFP8E4M3Layout

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    out, layers = dict(state), _quantized_layers(state, layout)
    scale_key = "scale_weight" if layout == "fp8_scaled" else "weight_scale"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the same bytes either way; a GPU is faster on 10 B
    for layer in layers:
        weight = state[f"{layer}.weight"].to(device).float()
        qdata, params = TensorCoreFP8E4M3Layout.quantize(weight, scale="recalculate")
        out[f"{layer}.weight"], out[f"{layer}.{scale_key}"] = qdata.cpu(), params.scale.reshape(()).cpu()
    if layout == "fp8_scaled":
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
        return out, {}
    return out, {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                      "layers": {layer: {"format": FP8_FORMAT} for layer in layers}})}


def ensure_quantized_diffusion_model(family: str, size: str, seed: int, directory: pathlib.Path,
                                     layout: str) -> pathlib.Path:
    """The family's built-in diffusion-model file in `layout`, made once beside the bf16 file it comes from."""
    from safetensors.torch import load_file, save_file

    source = ensure_diffusion_model(family, size, seed, directory)
    path = source.with_name(f"{source.stem}-{layout}.safetensors")
    if not path.is_file():
        from safetensors import safe_open
        with safe_open(str(source), "pt") as f:
            metadata = dict(f.metadata() or {})
        tensors, extra = quantized_state(load_file(str(source)), layout)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={**metadata, **extra, "overdrive_layout": layout})
        tmp.replace(path)
    return path
