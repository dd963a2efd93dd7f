"""switch_weights_: another checkpoint's weights into the running (compiled, quantized, step-cached) UNet or DiT, in
place, without recompiling: validated against the running architecture first, so a mismatch changes nothing."""
import json
import os
import pathlib

import torch
import torch.nn as nn

from ..compiler.switch_weights import (WeightMismatchError, check_compatible, copy_weights_, read_safetensors_files,
                                       unreadable)
from ..quantization.modules import float_reference, quantized_layers, requantize
from .installed import installed, installed_stack
from .targets import is_pipeline, target_modules

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
SHARD_INDEX = WEIGHTS_FILE + ".index.json"  # a large model's weights in several files (Flux, Wan, Qwen-Image)
MODEL_FOLDERS = ("", "unet", "transformer")  # for a bare module: a model folder, or a pipeline folder's denoiser
LDM_PREFIX = "model.diffusion_model."


def switch_weights_(target, weights) -> None:
    """Load `weights` into the UNet or DiT transformer of a pipeline (or into a module) in place; compiled graphs are
    reused as they are.

    weights: a state dict (diffusers key names), a module of the same architecture, a diffusers model folder (or a
    pipeline folder with unet/ or, for a DiT pipeline, transformer/; sharded weights too), or a .safetensors file in
    diffusers layout (keys optionally prefixed "unet.") or a single-file SD/SDXL checkpoint (LDM layout, converted
    with diffusers' own converter). Wan 2.2 A14B's two experts switch together from a pipeline folder (transformer/
    and transformer_2/; both are read before either is written, so host memory holds both); to switch one, pass
    pipe.transformer or pipe.transformer_2 as the target. Values are cast to the running dtypes and devices.
    Quantized layers are re-quantized from the new float weights (the per-layer decisions measured on the old weights
    are kept). A checkpoint of another architecture raises WeightMismatchError naming the missing/unexpected keys and
    wrong shapes; then nothing was written. A step cache's run ends: nothing computed with the old weights is reused.
    """
    denoisers = target_modules(target, "switch_weights_")
    experts = len(denoisers) > 1
    if experts and not (isinstance(weights, (str, os.PathLike)) and pathlib.Path(weights).is_dir()):
        raise TypeError("switch_weights_: this pipeline has two transformers (Wan 2.2 A14B's high- and low-noise "
                        "experts); pass a pipeline folder holding transformer/ and transformer_2/, or switch each "
                        "one: switch_weights_(pipe.transformer, ...) and switch_weights_(pipe.transformer_2, ...). "
                        "Nothing was changed.")
    # Everything is read and validated before anything is written: a mismatch in either expert writes nothing.
    switches = []
    for name, module in denoisers:
        layers = quantized_layers(module)
        reference = float_reference(module, layers)
        # A pipeline's denoiser reads its own folder of a pipeline folder (a lone transformer_2 too), or, where it is
        # the only one, a model folder; a bare module either.
        subfolders = ((name,) if experts else ("", name)) if is_pipeline(target) else MODEL_FOLDERS
        state, source = _read(weights, module, reference, subfolders)
        check_compatible(reference, state, source)
        switches.append((module, layers, reference, state, source))
    for module, layers, reference, state, source in switches:
        # In place: the pipeline owns its denoiser, and compiled graphs read these very tensors.
        copy_weights_(module, state, source, reference, rebuild=lambda: requantize(layers, state, copy=False))
        stack = installed_stack(module)
        if stack is not None and stack.cache_config is not None:
            installed(module).reset(new_weights=True)  # nothing measured on the old weights is reused


def _read(weights, module: nn.Module, reference: dict, subfolders: tuple):
    if isinstance(weights, nn.Module):
        return weights.state_dict(), f"{type(weights).__name__} module"
    if isinstance(weights, dict):
        bad = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))[:5]
        if bad:
            raise TypeError(f"switch_weights_: the state dict's values must be tensors ({bad} are not). Nothing was "
                            "changed.")
        return weights, "state dict"
    if isinstance(weights, (str, os.PathLike)):
        path = pathlib.Path(weights)
        return _read_path(path, module, reference, subfolders), str(path / subfolders[0])
    raise TypeError(f"switch_weights_ takes a state dict, a module, or a path to a .safetensors file or diffusers "
                    f"folder, not {type(weights).__name__}. Nothing was changed.")


def _read_path(path: pathlib.Path, module: nn.Module, reference: dict, subfolders: tuple) -> dict:
    if path.is_dir():
        files = next((found for sub in subfolders if (found := _model_files(path / sub))), None)
        if not files:
            where = " or ".join(f"{sub}/" if sub else "itself" for sub in subfolders)
            raise FileNotFoundError(
                f"switch_weights_: {path} holds no {WEIGHTS_FILE} (or {SHARD_INDEX} and its shards) in {where}; "
                "pass a diffusers model or pipeline folder, or a .safetensors file. Nothing was changed.")
        return read_safetensors_files(files, reference, prefixes=("unet.", ""), name=files[0].parent)
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
    return read_safetensors_files([path], reference, prefixes=("unet.", ""))


def _model_files(folder: pathlib.Path) -> list | None:
    """The weight files of a diffusers model folder: one file, or the shards its index names; None if it has none."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / SHARD_INDEX
    if not index.is_file():
        return None
    try:
        return [folder / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise unreadable(index, error) from error


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
