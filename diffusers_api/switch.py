"""switch_weights_: another checkpoint's weights into the running (compiled, quantized, DeepCached) UNet, in place,
without recompiling: validated against the running architecture first, so a mismatch changes nothing."""
import os
import pathlib

import torch
import torch.nn as nn

from ..compiler.switch_weights import WeightMismatchError, copy_weights_, read_safetensors_subset
from ..quantization.modules import float_reference, quantized_layers, requantize
from .installed import installed, installed_stack
from .targets import target_module

DIFFUSERS_FILES = ("diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.safetensors",
                   "transformer/diffusion_pytorch_model.safetensors")
LDM_PREFIX = "model.diffusion_model."


def switch_weights_(target, weights) -> None:
    """Load `weights` into the UNet or DiT transformer of a pipeline (or into a module) in place; compiled graphs are
    reused as they are.

    weights: a state dict (diffusers key names), a module of the same architecture, a diffusers model folder (or a
    pipeline folder with unet/ or, for a DiT pipeline, transformer/), or a .safetensors file in diffusers layout (keys
    optionally prefixed "unet.") or a single-file SD/SDXL checkpoint (LDM layout, converted with diffusers' own
    converter). Values are cast to the running dtypes and devices. Quantized layers are re-quantized from the new
    float weights (the per-layer decisions measured on the old weights are kept). A checkpoint of another architecture
    raises WeightMismatchError naming the missing/unexpected keys and wrong shapes; then nothing was written.
    A step cache's run ends: nothing computed with the old weights is reused.
    """
    module = target_module(target, "switch_weights_")
    layers = quantized_layers(module)
    reference = float_reference(module, layers)
    state, source = _read(weights, module, reference)
    # Validated first: a mismatch writes nothing. In place: the pipeline owns its UNet, and compiled graphs read
    # these very tensors.
    copy_weights_(module, state, source, reference, rebuild=lambda: requantize(layers, state, copy=False))
    stack = installed_stack(module)
    if stack is not None and stack.cache is not None:
        installed(module).reset()  # features computed with the old weights are never reused


def _read(weights, module: nn.Module, reference: dict):
    if isinstance(weights, nn.Module):
        return weights.state_dict(), f"{type(weights).__name__} module"
    if isinstance(weights, dict):
        bad = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))[:5]
        if bad:
            raise TypeError(f"switch_weights_: the state dict's values must be tensors ({bad} are not). Nothing was "
                            "changed.")
        return weights, "state dict"
    if isinstance(weights, (str, os.PathLike)):
        return _read_path(pathlib.Path(weights), module, reference), str(weights)
    raise TypeError(f"switch_weights_ takes a state dict, a module, or a path to a .safetensors file or diffusers "
                    f"folder, not {type(weights).__name__}. Nothing was changed.")


def _read_path(path: pathlib.Path, module: nn.Module, reference: dict) -> dict:
    if path.is_dir():
        found = [path / name for name in DIFFUSERS_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"switch_weights_: {path} holds none of {list(DIFFUSERS_FILES)}; pass a diffusers "
                                    "model or pipeline folder, or a .safetensors file. Nothing was changed.")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"switch_weights_: {path} does not exist. Nothing was changed.")
    if path.suffix != ".safetensors":
        raise ValueError(f"switch_weights_: {path} is not a .safetensors file; convert it or pass its state dict. "
                         "Nothing was changed.")
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device="cpu") as f:
        ldm = [k for k in f.keys() if k.startswith(LDM_PREFIX)]
        if ldm:
            return _convert_ldm({k: f.get_tensor(k) for k in ldm}, module, path)
    return read_safetensors_subset(path, reference, prefixes=("unet.", ""))


def _convert_ldm(state: dict, module: nn.Module, path) -> dict:
    """A single-file SD/SDXL checkpoint's UNet in diffusers key names (diffusers' own converter, this UNet's config)."""
    config = getattr(module, "config", None)
    if config is None:
        raise WeightMismatchError(f"{path} is a single-file (LDM layout) checkpoint, which only converts for a "
                                  "diffusers UNet2DConditionModel. The model was left unchanged.")
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    try:
        return convert_ldm_unet_checkpoint(state, config)
    except Exception as error:  # noqa: BLE001 - a checkpoint of another layout: say so, change nothing
        raise WeightMismatchError(f"{path} could not be converted to this UNet's layout ({type(error).__name__}: "
                                  f"{error}); it is not a checkpoint of this architecture. The model was left "
                                  "unchanged.") from error
