"""Copies of a ComfyUI model around another diffusion model: Switch Weights' (new weights) and Compile Model's classic
copy of a dynamic-VRAM model (the same weights, shared)."""
import copy
import functools
import weakref

import torch

import comfy.model_patcher
from comfy.patcher_extension import CallbacksMP

from ..compiler.switch_weights import structural_copy
from .file_weights import FILE_TENSORS, point_at_file, record_file_tensors
from .load_state import LAYER_LOADER_STATE, MODEL_LOADER_STATE, forget_load_state

# What dynamic VRAM sets on each layer at its loads, beyond LAYER_LOADER_STATE: casting at every call and the layer's
# name for its stochastic rounding. A classic copy takes its layer classes' defaults instead.
DYNAMIC_LAYER_STATE = ("comfy_cast_weights", "seed_key")
CLASSIC_TWIN = "overdrive_classic_twin"  # on a dynamic-VRAM BaseModel: a weak reference to its classic copy
CLASSIC_KEPT = "overdrive_classic_clones"  # on a dynamic-VRAM BaseModel: its newest classic clones (see keep_newest)
KEPT_KEY = "overdrive_classic_kept"  # the ON_PRE_RUN callback's key
LOADER_RECORDS = "overdrive_loader_records"  # on the classic copy: its loader's records, shared by its clones
# What Overdrive keeps on a BaseModel about its own copies and loads: not carried into a copy of it.
OVERDRIVE_RECORDS = (CLASSIC_TWIN, CLASSIC_KEPT, FILE_TENSORS, LOADER_RECORDS, "_apply")


def with_diffusion_model(model, diffusion_model):
    """A clone of `model` around a new BaseModel that holds `diffusion_model` (the rest copied, it is small).

    ComfyUI treats clones of one BaseModel as sharing weights: it would keep the old weights on the GPU and skip
    moving the new ones. A BaseModel of its own makes the new model a separate model to ComfyUI's memory management
    (loaded, offloaded and accounted for like any checkpoint), and leaves `model` untouched."""
    base = base_model_around(model.model, diffusion_model)
    mark_unloaded(base, model.offload_device)
    # ComfyUI's clone convention: the model and the loader's records of what it changed on it (weights and buffers
    # moved or patched, object patches applied, pinned weights), none yet for the new model.
    return model.clone(model_override=(base, ({}, {}, {}, set())))


def base_model_around(base_model, diffusion_model):
    """A copy of ComfyUI's BaseModel `base_model` holding `diffusion_model`, without the loader's state of
    `base_model` nor Overdrive's records on it."""
    replace = {id(base_model.diffusion_model): diffusion_model}
    config = getattr(base_model, "model_config", None)
    if config is not None:  # the architecture's, the same for both; it cannot be deep-copied
        replace[id(config)] = config
    loader_state = [name for name in (*MODEL_LOADER_STATE, *OVERDRIVE_RECORDS) if name in vars(base_model)]
    for name, value in vars(base_model).items():
        if isinstance(value, comfy.model_patcher.ModelPatcher) or name in loader_state:
            replace[id(value)] = None  # the patcher of a prompt running now; the loader's state of this model
    base = copy.deepcopy(base_model, replace)
    for name in loader_state:
        delattr(base, name)  # the new patcher makes its own
    return base


# What ComfyUI's loader records about a loaded model (on the BaseModel and on each layer), as it is before any load.
_UNLOADED_BASE_MODEL = {"model_loaded_weight_memory": 0, "lowvram_patch_counter": 0, "model_lowvram": False,
                        "current_weight_patches_uuid": None}


def mark_unloaded(base, device) -> None:
    """A copy's weights are tensors with no patch applied, but the copies of a loaded model say "loaded". Left so,
    ComfyUI counts the copy as already on the GPU: it neither unloads other models to make room (an SDXL run went out
    of memory after a few switches) nor applies LoRA patches to layers marked as patched."""
    if hasattr(base, "model_loaded_weight_memory"):
        base.device = device
    for name, value in _UNLOADED_BASE_MODEL.items():
        if hasattr(base, name):
            setattr(base, name, value)
    forget_load_state([base.diffusion_model])


def classic_clone(model):
    """A clone of dynamic-VRAM `model` on ComfyUI's classic loader, for Compile Model (comfy_host/dynamic_vram.py).

    ComfyUI's own way (`clone(disable_dynamic=True)`) loads the file again at every call, and with dynamic VRAM on in
    the process its layers clone each tensor of the file into host memory: a second float model per Compile Model run,
    kept as long as ComfyUI's cache keeps the node's output. This copy shares the dynamic model's tensors instead (the
    memory-mapped file's), so it costs no host memory, and one copy per BaseModel serves every Compile Model run over
    it: a LoRA or prompt change runs the same classic model, which ComfyUI keeps loaded."""
    base = model.model
    held = getattr(base, CLASSIC_TWIN, None)
    twin = held() if held is not None else None
    if twin is None:
        twin = _classic_twin(model)
        setattr(base, CLASSIC_TWIN, weakref.ref(twin))  # goes with the last clone that runs it
    clone = model.clone(disable_dynamic=True, model_override=(twin, getattr(twin, LOADER_RECORDS)))
    keep_newest(base, clone)
    return clone


def keep_newest(base, clone) -> None:
    """`clone` (a classic clone over `base`'s copy) kept by `base` until a newer one starts a sampling run.

    A LoRA, strength or prompt change makes ComfyUI drop the last prompt's Compile Model output before the node runs
    again: kept, the copy it ran lives on for the next run, with its module's CUDA graphs and step decisions
    (forward_patch.py keeps them per module), and ComfyUI's loader finds that copy's weights on the GPU. The clone
    ComfyUI loaded last stays kept until then (a loaded clone gone while its copy lives reads to ComfyUI as a leaked
    model). Its `parent`, a patcher over `base`, is let go: through this list it would be a reference cycle holding the
    file's model."""
    clone.parent = None
    base.__dict__.setdefault(CLASSIC_KEPT, []).append(clone)
    clone.remove_callbacks_with_key(CallbacksMP.ON_PRE_RUN, KEPT_KEY)
    clone.add_callback_with_key(CallbacksMP.ON_PRE_RUN, KEPT_KEY, functools.partial(_newest_only, weakref.ref(base)))


def _newest_only(base_ref, patcher) -> None:
    """ON_PRE_RUN (a sampling run starts, its models loaded): where `patcher` runs the classic copy, ComfyUI's load
    replaced the copy's other clones, so only the newest stays kept, and the one `patcher` was cloned from (ComfyUI
    counts the model as that one once `patcher` is gone)."""
    base = base_ref()
    kept, held = getattr(base, CLASSIC_KEPT, None), getattr(base, CLASSIC_TWIN, None)
    if not kept or held is None or patcher.model is not held():
        return  # another model's run (a Switch Weights copy made from a classic clone): nothing of these replaced
    source = patcher
    while source is not None and not any(source is clone for clone in kept):
        source = source.parent
    kept[:] = [clone for clone in kept if clone is kept[-1] or clone is source]


def _classic_twin(model):
    """The BaseModel of `classic_clone`: `model`'s, copied with its diffusion model's tensors shared."""
    tree = model.model.diffusion_model
    shared, file_tensors = {}, {}
    for name, tensor in tree.named_parameters():
        key = f"diffusion_model.{name}"
        original = (model.backup[key].weight if key in model.backup else tensor).detach()  # not dynamic VRAM's copy
        # a Parameter of its own: ComfyUI moving it (`param.data = ...`) must not move the dynamic model's
        shared[id(tensor)] = torch.nn.Parameter(original, requires_grad=False)
        file_tensors[key] = original
    for name, tensor in tree.named_buffers():
        shared[id(tensor)] = model.backup_buffers.get(f"diffusion_model.{name}", tensor)
    twin_tree = structural_copy(tree, shared, LAYER_LOADER_STATE)
    for layer in twin_tree.modules():
        for name in DYNAMIC_LAYER_STATE:
            layer.__dict__.pop(name, None)
    twin = base_model_around(model.model, twin_tree)
    mark_unloaded(twin, model.offload_device)
    record_file_tensors(twin, file_tensors)
    twin._apply = functools.partial(_apply_keeping_file_tensors, weakref.ref(twin))
    setattr(twin, LOADER_RECORDS, ({}, {}, {}, set()))  # shared by its clones, as ComfyUI shares a model's records
    return twin


def _apply_keeping_file_tensors(twin_ref, fn, recurse=True):
    """The classic copy's `_apply` (holding it weakly: no reference cycle keeps it alive): where ComfyUI unloads it to the
    host (`model.to(offload_device)`), its weights point at the file's tensors again instead of being copied."""
    twin = twin_ref()
    if torch.cuda.is_available() and fn(torch.empty(0, device="cuda")).device.type == "cpu":
        tree = twin.diffusion_model
        layers = {name: module for name, module in tree.named_modules() if module._parameters}
        point_at_file(layers, getattr(twin, FILE_TENSORS, {}), set())
    return type(twin)._apply(twin, fn, recurse)
