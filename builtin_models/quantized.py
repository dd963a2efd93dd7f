"""Built-in diffusion-model files in the quantized layouts users download today, made from the family's built-in bf16
file with ComfyUI's own quantized-tensor classes (comfy.quant_ops), and read back by ComfyUI's loader as it reads the
released files (comfy/utils.py convert_old_quants, comfy.ops.mixed_precision_ops):

- "fp8_scaled" (Wan 2.2's `*_fp8_scaled`, the older convention): every block linear's weight in e4m3 with a
  `<layer>.scale_weight`, and a `scaled_fp8` marker tensor;
- "fp8_mixed" (Flux.2's `flux2_dev_fp8mixed`, Qwen-Image's `_fp8_hq`): the block linears but their modulation layers
  in e4m3 with a `<layer>.weight_scale`, listed per layer in the file's `_quantization_metadata`; the rest in bf16;
- "fp8_e4m3fn" (Flux.1-dev's `flux1-dev-fp8`, the first fp8 files): the block linears' weights cast to e4m3, no scale;
- "int8_convrot" (Z-Image's `z_image_turbo_int8_convrot`): int8 with a scale per output channel after a group-wise
  Hadamard rotation, a `<layer>.comfy_quant` entry per layer saying so;
- "nvfp4" (Qwen-Image's and Z-Image's `_nvfp4`): 4-bit e2m1 pairs with an e4m3 scale per 16 values and one per
  tensor, per-layer `comfy_quant` entries; Blackwell runs it, other GPUs dequantize.
"""
from __future__ import annotations

import json
import pathlib
import re

import torch

from ..core.storage import atomic_file
from .dit import MODULATION, ensure_diffusion_model

LAYOUTS = ("fp8_scaled", "fp8_mixed", "fp8_e4m3fn", "int8_convrot", "nvfp4")
BLOCK_LINEAR = re.compile(r"(^|\.)(blocks|double_blocks|single_blocks|transformer_blocks|layers|joint_blocks)\.\d+\.")
FP8_FORMAT = "float8_e4m3fn"
CONVROT_GROUP = 256  # the released files' Hadamard group; a narrower layer takes the largest power of 4 dividing it


def _quantized_layers(state: dict, layout: str) -> list:
    """The layers (key without `.weight`) a file of `layout` stores quantized: 2-D block weights both of whose sides
    are multiples of 16 (the fp8 GEMMs' and nvfp4's blocks); "fp8_mixed" leaves the modulation layers in bf16."""
    layers = []
    for key, tensor in state.items():
        match = BLOCK_LINEAR.search(key)
        if not key.endswith(".weight") or tensor.dim() != 2 or match is None:
            continue
        if tensor.shape[0] % 16 or tensor.shape[1] % 16 or (layout == "fp8_mixed" and MODULATION.search(key)):
            continue
        layers.append(key[: -len(".weight")])
    return layers


def _per_layer_entries(layer: str, weight: torch.Tensor, layout: str) -> dict:
    """{key: tensor} of one layer stored as comfy-kitchen writes it (QuantizedTensor.state_dict), with the
    `comfy_quant` entry ComfyUI's loader reads the format from."""
    from comfy.quant_ops import QuantizedTensor, TensorCoreNVFP4Layout, TensorWiseINT8Layout

    if layout == "int8_convrot":
        group = next(g for g in (CONVROT_GROUP, 64, 16) if weight.shape[1] % g == 0)  # powers of 4: Hadamard sizes
        qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=True,
                                                      convrot_groupsize=group)
        name, conf = "TensorWiseINT8Layout", {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
    else:
        qdata, params = TensorCoreNVFP4Layout.quantize(weight)
        name, conf = "TensorCoreNVFP4Layout", {"format": "nvfp4"}
    entries = {key: value.cpu() for key, value in QuantizedTensor(qdata, name, params).state_dict(f"{layer}.weight")
               .items()}
    entries[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    return entries


def quantized_state(state: dict, layout: str) -> tuple:
    """(tensors, metadata) of `state` (a bf16 diffusion model) in `layout`."""
    from comfy.quant_ops import TensorCoreFP8E4M3Layout

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    out, layers = dict(state), _quantized_layers(state, layout)
    scale_key = "scale_weight" if layout == "fp8_scaled" else "weight_scale"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the same bytes either way; a GPU is faster on 10 B
    for layer in layers:
        weight = state[f"{layer}.weight"].to(device)
        if layout == "fp8_e4m3fn":
            out[f"{layer}.weight"] = weight.to(torch.float8_e4m3fn).cpu()
        elif layout in ("int8_convrot", "nvfp4"):
            del out[f"{layer}.weight"]
            out.update(_per_layer_entries(layer, weight, layout))
        else:
            qdata, params = TensorCoreFP8E4M3Layout.quantize(weight.float(), scale="recalculate")
            out[f"{layer}.weight"], out[f"{layer}.{scale_key}"] = qdata.cpu(), params.scale.reshape(()).cpu()
    if layout == "fp8_scaled":
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    if layout != "fp8_mixed":
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
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata={**metadata, **extra, "overdrive_layout": layout})
    return path
