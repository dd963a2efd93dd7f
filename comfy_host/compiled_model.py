"""Compile Model and Compile VAE on ComfyUI's side: Overdrive's compiled forward installed on a clone of the model as
an object patch (the input MODEL and other clones keep running eager), the VAE's decode (and encode) compiled."""
import copy
import logging

import torch

from comfy.patcher_extension import CallbacksMP

from ..compiler import CompiledMethod, CompileOptions
from ..compiler.eager_vaes import eager_reason
from ..compiler.layouts import conv_weights_channels_last_
from ..core.stack import Stack
from . import checkpoint_formats, quantize_patches
from .attention_override import EXACT, install_attention
from .cache_folder import comfy_cache_dir
from .dynamic_vram import WORKSPACE_MIN_BYTES, compile_clone, is_dynamic
from .forward_patch import FORWARD, install, installed_stack
from .progress import comfy_progress

log = logging.getLogger("overdrive")


def compile_options(**settings) -> CompileOptions:
    """The nodes' settings, with compiled artifacts kept in Overdrive's folder beside ComfyUI's models."""
    return CompileOptions(**settings, cache_dir=str(comfy_cache_dir("compiled")))


def release_held_memory(patcher, unpatch_all) -> None:
    """ComfyUI unloads the model (a detach that unpatches; it detaches without unpatching before every run): the
    memory its precompiled frames (a compiled whole forward) and its blocks' CUDA graphs (a DiT's) hold goes with it."""
    if not unpatch_all:
        return
    forward = patcher.object_patches.get(FORWARD)
    released = []
    for name in ("release_precompiled", "release_graphs"):
        release = getattr(forward, name, None)
        if release is not None:
            release()
            released.append(name)
    if released:  # the next run records (and loads its precompiled frames) again: say why it is slower
        log.info("Overdrive Compile Model: ComfyUI unloaded %s; its CUDA graphs and precompiled frames are freed and "
                 "recorded again at its next run.", type(patcher.model).__name__)


def compiled_model(model, options: CompileOptions, fast_attention: bool):
    """A clone of `model` running Overdrive's compiled forward (with the 16-bit attention chooser where
    `fast_attention`); a model whose weights stream per layer under dynamic VRAM is returned uncompiled."""
    patched, reloaded = compile_clone(model)
    checkpoint_formats.advise_before_compile(patched)
    if fast_attention:  # also where the blocks stay uncompiled below
        log.info("Overdrive Compile Model %s", install_attention(patched, EXACT))
    if reloaded:  # a new module tree: Quantize Model's layers stand in for its float layers now
        quantize_patches.retarget(patched)
    elif is_dynamic(patched):  # its weights stream per layer: compiled blocks would run slower than eager
        return patched
    # An object patch is applied while this clone is loaded and undone after, so the input MODEL and other
    # clones keep running eager; LoRA weight patches still resolve, because the module tree is unchanged.
    # A DeepCache already on the model is kept, with its paths compiled.
    install(patched, (installed_stack(patched) or Stack()).with_compile(options))
    patched.model_options[quantize_patches.WORKSPACE_KEY] = WORKSPACE_MIN_BYTES  # where 8-bit layers stream
    if options.precompile or options.cuda_graphs:
        patched.add_callback(CallbacksMP.ON_DETACH, release_held_memory)
    return patched


def compiled_vae(vae, options: CompileOptions, compile_encoder: bool):
    """A copy of `vae` decoding (and encoding, where `compile_encoder`) through compiled code; a VAE that runs better
    eager is returned itself, its 3D convolutions in the channels-last layout."""
    reason = eager_reason(vae.first_stage_model)
    if reason is not None:
        convs = conv_weights_channels_last_(vae.first_stage_model, torch.nn.Conv3d)
        log.info("Overdrive Compile VAE: %s (%d convolutions).", reason, convs)
        return vae
    patched = copy.copy(vae)
    patched.patcher = vae.patcher.clone()
    autoencoder = vae.first_stage_model
    methods = ["decode", "encode"] if compile_encoder else ["decode"]
    for method in methods:
        patched.patcher.add_object_patch(method, CompiledMethod(autoencoder, method, options, reporter=comfy_progress))
    return patched
