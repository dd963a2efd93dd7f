"""Switch Weights / Switch Diffusion Model on ComfyUI's side: a clone of a model running another file's weights of the
same architecture through the same compiled blocks (and quantized layers made from the new weights)."""
import logging
import time

import comfy.utils
import folder_paths

from ..compiler import twin_with_weights
from ..compiler.switch_weights import (SWITCH_LOCK, check_compatible, module_keys, read_safetensors_subset,
                                       reference_tensors, unreadable, warn_if_not_finite)
from . import checkpoint_formats
from .load_state import LAYER_LOADER_STATE
from .model_copies import with_diffusion_model
from .forward_patch import rebuild
from .quantize_patches import float_view, requantize_onto

log = logging.getLogger("overdrive")


# ComfyUI's loaders that reload a model from its file (ModelPatcher.cached_patcher_init, whose first argument is the
# file), per folder of the files the switch nodes read.
RELOADERS = {"diffusion_models": "load_diffusion_model", "checkpoints": "load_checkpoint_guess_config"}


def reloading(init, folder: str, path: str):
    """The switched model's reload recipe (what ComfyUI's non-dynamic clones and multi-GPU copies, and Parallel
    Model's workers, load it from): the original loader with the new file where the loader reads that folder's files,
    else None (nothing reloads it rather than reloading the old weights)."""
    if init is None or getattr(init[0], "__name__", None) != RELOADERS.get(folder):
        return None
    load, arguments, *index = init
    return (load, (path, *arguments[1:]), *index)


def load_unet_weights(path, reference):
    if str(path).endswith(".safetensors"):
        return read_safetensors_subset(path, reference)
    try:
        state = comfy.utils.load_torch_file(path)  # .ckpt/.pt: ComfyUI's own safe loader
    except Exception as error:  # noqa: BLE001 - torch's unpickling errors name neither the file nor the consequence
        raise unreadable(path, error) from error
    return {name: state[key] for name, key in module_keys(state, reference, path).items()}


def switch_weights(model, folder: str, name: str):
    """A clone of `model` running the weights of `name` in ComfyUI's `folder` through the same compiled blocks."""
    start = time.perf_counter()
    path = folder_paths.get_full_path(folder, name)
    if path is None:
        raise FileNotFoundError(f"{name!r} is not in ComfyUI's {folder} folder.")
    current = float_view(model)  # a loaded quantized model has 8-bit layers in the shared tree
    with SWITCH_LOCK:  # one switch at a time; the running model is never written to
        reference = reference_tensors(current)
        if checkpoint_formats.is_mixed_precision(current):  # a checkpoint stored quantized: ComfyUI's conversion
            state = checkpoint_formats.converted_state(path, reference)
            check_compatible(reference, state, source=name)
            warn_if_not_finite(state, name)
            twin = checkpoint_formats.twin_loaded_by_its_layers(current, state, LAYER_LOADER_STATE)
        else:
            state = load_unet_weights(path, reference)
            twin = twin_with_weights(current, state, source=name, loader_state=LAYER_LOADER_STATE)
        switched = with_diffusion_model(model, twin)
        switched.cached_patcher_init = reloading(model.cached_patcher_init, folder, path)
        requantized = requantize_onto(switched, twin)
        # The same Stack (compiled, step cache) over the twin. Same architecture: same graphs, no recompile.
        stack = rebuild(switched)
        compiled = stack is not None and stack.compile is not None
    log.info("Overdrive: switched diffusion-model weights to %s in %.2f s (%s%s)", name,
             time.perf_counter() - start, "compiled graph reused" if compiled else "model was not compiled",
             f"; {len(requantized)} quantized layers re-quantized from the new weights" if requantized else "")
    return switched
