"""Quantized layers as ComfyUI ModelPatcher object patches: installed on a patcher with their LoRA router
(quantized_patch_routing.py) and device follower (quantized_follower.py), carried over to a new module tree or onto
another checkpoint's weights, and the diffusion model read as its checkpoint has it (float_view).
"""
import logging

import torch

import comfy.sampler_helpers
from comfy.patcher_extension import CallbacksMP, WrappersMP

from ..compiler.switch_weights import structural_copy
from ..quantization import gelu_fusion
from ..quantization.kernels import fp8_gemm_gelu_runs_as
from ..quantization.linear_layers import float_weight
from ..quantization.modules import requantize
from . import file_weights
from .load_state import LAYER_LOADER_STATE
from .quantized_follower import CLASS_PATCH, QuantizedModules, home_unless_loaded, home_when_unfollowed
from .quantized_lora import PREFIX, SidePaths, place_side_paths
from .quantized_patch_routing import QuantizedPatchRouter
from .quantized_sets import QuantizedSet
from .quantized_state import (FOLLOWER, compute_dtype, followers, is_quantized, quantized_modules,  # noqa: F401
                              quantized_set_of, resident_bytes)

log = logging.getLogger("overdrive.quantization")
ROUTER_KEY = "overdrive_quantized_patches"  # the ON_CLONE callback that routes each clone's add_patches
ACTIVATIONS_KEY = "overdrive_quantized_activations"  # the PREPARE_SAMPLING wrapper's key (record_activations)
MEASURE_KEY = "overdrive_quantized_working_memory"  # the SAMPLER_SAMPLE wrapper's key (measure_working_memory)
# model_options key: the working memory a compiled model needs beside one call's activations (Compile Model sets it),
# kept free too where some quantized layers stream
WORKSPACE_KEY = "overdrive_compiled_workspace"


def install_quantized(patcher, quantized: QuantizedSet, layers: dict, float_size: int | None = None) -> None:
    """`quantized`'s layers installed on `patcher` as object patches (`layers`: {name: the layer this patcher runs, the
    set's own or a copy baked for it}; LoRA side paths where its patches need them), with the activations of the MLPs
    whose two fp8 GEMMs run as one fused pair (quantization/gelu_fusion.py), the LoRA router and the device follower;
    its size as ComfyUI reads it (ModelPatcher.size) becomes the quantized model's. `float_size`: the checkpoint's float
    size where `patcher` already reports a quantized one (a re-install)."""
    float_size = patcher.model_size() if float_size is None else float_size
    tree = patcher.model.diffusion_model
    originals = {name: tree.get_submodule(name) for name in layers}
    originals = {name: module for name, module in originals.items() if not is_quantized(module)}
    for name, layer in layers.items():
        patcher.add_object_patch(PREFIX + name, layer)
    place_side_paths(patcher, quantized.side_paths, layers)
    fused = gelu_fusion.fuse(tree, {name: patcher.object_patches[PREFIX + name] for name in layers},
                             compute_dtype(patcher))
    for name, cls in fused.items():
        patcher.add_object_patch(f"{PREFIX}{name}{CLASS_PATCH}", cls)
    if fused:
        log.info("Overdrive quantization: %d MLP(s) run their first fp8 GEMM, tanh-GELU and the second GEMM's input "
                 "cast %s.", gelu_fusion.mlp_count(fused),
                 fp8_gemm_gelu_runs_as(patcher.load_device))
    router = QuantizedPatchRouter(quantized)
    router.guard(patcher)
    follower = QuantizedModules(quantized, layers, originals, patcher.load_device, patcher.offload_device, tree,
                                patcher.model, file_weights.source_file(patcher), patcher.backup)
    follower.float_size = float_size
    home_when_unfollowed(follower)
    for kind, callback in ((CallbacksMP.ON_CLONE, router.on_clone), (CallbacksMP.ON_DETACH, follower.on_detach),
                           (CallbacksMP.ON_CLEANUP, follower.on_cleanup), (CallbacksMP.ON_LOAD, follower.on_load),
                           (CallbacksMP.ON_REGISTER_ALL_HOOK_PATCHES, router.on_hook_patches)):
        patcher.remove_callbacks_with_key(kind, ROUTER_KEY)
        patcher.add_callback_with_key(kind, ROUTER_KEY, callback)
    patcher.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY)
    patcher.add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY, record_activations)
    patcher.remove_wrappers_with_key(WrappersMP.SAMPLER_SAMPLE, MEASURE_KEY)
    patcher.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, MEASURE_KEY, measure_working_memory)
    patcher.set_model_patch(follower, FOLLOWER)
    # ComfyUI loads a model whole (model.to(device), every tensor) only where its size fits; told the float size, it
    # loaded a 4-bit Wan 14B that fits a short card partially, leaving the blocks' own modulation tensors in host
    # memory, which kept every compiled block off CUDA graphs.
    patcher.size = resident_bytes(patcher)


def record_activations(executor, model, noise_shape, conds, *args, **kwargs):
    """A PREPARE_SAMPLING wrapper: what this sampling needs beside the quantized layers, for placing them at the load
    that follows: ComfyUI's own estimate of one model call's activations (what its partial loader keeps free,
    comfy.sampler_helpers.estimate_memory), a compiled model's working memory floor, and the sampling's kind, under
    which its runs are measured (QuantizedModules.kept_free). A video model's activations outgrow the fixed reserve
    (gpu_budget.ACTIVATIONS_BYTES): Wan 14B's 8-bit layers placed beside it ran a short card out of memory in the first
    step."""
    _, minimum = comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)
    workspace = int(model.model_options.get(WORKSPACE_KEY, 0))
    for follower in followers(model):  # shared by clones: set for the one sampling now
        follower.activations_bytes = int(minimum)
        follower.workspace_bytes = workspace
        follower.sampling_key = (tuple(noise_shape), int(minimum), workspace)
    return executor(model, noise_shape, conds, *args, **kwargs)


def measure_working_memory(executor, guider, *args, **kwargs):
    """A SAMPLER_SAMPLE wrapper (the model is loaded and its quantized layers placed): a completed run's working memory
    measured for the next placement."""
    patcher = getattr(guider, "model_patcher", None)  # ComfyUI's guiders all have one; another extension's may not
    measured = [f for f in followers(patcher) if f.sampling_key is not None] if patcher is not None else []
    for follower in measured:
        follower.working_memory.begin(follower.sampling_key, follower.load_device)
    try:
        result = executor(guider, *args, **kwargs)
    except BaseException:
        for follower in measured:
            follower.working_memory.abandon()
        raise
    for follower in measured:
        follower.working_memory.end(follower.streaming.in_flight_bytes() if follower.streamed_bytes else 0)
    return result


def requantize_onto(patcher, diffusion_model) -> list:
    """SwitchWeights on a quantized model: the same layers, the same format and scales rule, quantized again from
    `diffusion_model`'s weights (the new checkpoint's), without re-measuring. New layers, so the model that was
    running keeps its own; its LoRAs run beside them as before. Returns the names of the layers re-quantized."""
    old = quantized_modules(patcher)
    if not old:
        return []
    state = {}
    for name in old:  # each layer's float weights, dequantized where the new checkpoint stores the layer in low bits
        layer = diffusion_model.get_submodule(name)
        state[f"{name}.weight"], state[f"{name}.bias"] = float_weight(layer), layer.bias
    previous = quantized_set_of(patcher)
    home_unless_loaded(previous, patcher.offload_device)  # the copies are made where the layers wait: not on the card
    # quantized on the card even where the layers wait on the host (it took the host most of a switch's time)
    fresh = requantize(old, state, copy=True, quantize_on=patcher.load_device)
    switched = QuantizedSet(fresh, previous.report, SidePaths(fresh, previous.side_paths.dtype),
                            context=previous.context)
    reinstall(patcher, switched, fresh)
    return sorted(fresh)


def retarget(patcher) -> int:
    """After `patcher`'s model was made anew (Compile Model's classic copy, comfy_host/dynamic_vram.py): the same quantized
    layers installed over the new module tree, whose float layers they now stand in for. Returns how many."""
    layers = quantized_modules(patcher)
    if layers:
        reinstall(patcher, quantized_set_of(patcher), layers)
    return len(layers)


def reinstall(patcher, quantized: QuantizedSet, layers: dict) -> None:
    """`layers` of `quantized` installed on `patcher` in place of the quantized layers it has (their follower dropped),
    its float size carried over."""
    old = followers(patcher)
    float_size = old[0].float_size if old else None
    patcher.model_options["transformer_options"]["patches"][FOLLOWER] = []
    install_quantized(patcher, quantized, layers, float_size)


def float_view(patcher):
    """`patcher`'s diffusion model as its checkpoint has it: where quantized layers are swapped into the shared
    module tree right now (a loaded quantized model), the float layers they replaced and the classes the fused MLPs
    swapped. Shares every tensor; only read (SwitchWeights builds its twin from it), never run."""
    current = patcher.model.diffusion_model
    originals = {key[len(PREFIX):]: module for key, module in patcher.object_patches_backup.items()
                 if key.startswith(PREFIX) and isinstance(module, torch.nn.Module)}
    if not originals:
        return current
    shared = {id(current.get_submodule(name)): original for name, original in originals.items()}
    # every tensor: the parameters themselves too, since ComfyUI's quantized layers give their state dict the stored
    # parts of a QuantizedTensor weight instead (whose wrapper cannot be deep-copied)
    tensors = (*current.parameters(), *current.buffers(), *current.state_dict(keep_vars=True).values())
    shared.update({id(t): t for t in tensors})
    view = structural_copy(current, shared, LAYER_LOADER_STATE)  # the loader's handles and views stay with `current`
    for module in view.modules():  # the fused MLPs' own classes too (a compiled graph is keyed by the classes)
        gelu_fusion.restore_class(module)
    return view
