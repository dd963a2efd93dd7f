"""compile_: torch.compile through Overdrive's compiler core, so graphs are shared per architecture in memory and
cached on disk exactly as for the ComfyUI nodes (same CompiledMethod, same fingerprints, same cache keys)."""
import logging

import torch.nn as nn

from ..attention.routing import unwrapped
from ..core.blockwise import BlockwiseForward
from ..compiler import CompiledMethod, CompileOptions
from ..compiler.eager_vaes import eager_reason
from ..compiler.layouts import conv_weights_channels_last_
from ..core.stack import Stack
from .installed import install_each, installed_stack
from .targets import is_pipeline, pipeline_denoisers, pipeline_vae

log = logging.getLogger("overdrive")


def compile_(target, options: CompileOptions | None = None, *, methods=("forward",)) -> dict:
    """Compile in place; returns {"unet.forward": CompiledMethod, ...} (their `.graph` has the compile stats).

    - a diffusers pipeline: its UNet's forward (a DiT pipeline: its transformer's, one graph per distinct block; Wan
      2.2 A14B's two experts share them) and its VAE's decode (Wan's video VAE: channels_last_3d convolutions instead,
      compiler/eager_vaes.py); their conv weights are converted to channels-last (see `_conv_weights_channels_last`);
    - a torch.nn.Module: `methods` of it (default: forward).
    Compiling happens at the first call of each; if compiling or running compiled code ever fails, that model runs
    eager from then on with a warning. With DeepCache on the UNet (deepcache_), its two paths are compiled too.
    Calling compile_ again replaces the options.
    """
    options = CompileOptions() if options is None else options
    if not isinstance(options, CompileOptions):
        raise TypeError(f"compile_: options must be a CompileOptions, not {type(options).__name__}; e.g. "
                        "CompileOptions(mode='max-autotune'). Nothing was changed.")
    video_vae = None  # a VAE left uncompiled (compiler/eager_vaes.py): its 3-D convolutions go channels-last instead
    if is_pipeline(target):
        plan = [(name, module, "forward") for name, module in pipeline_denoisers(target, "compile_")]
        vae = pipeline_vae(target)
        if vae is not None and eager_reason(vae) is not None:
            video_vae = vae
        elif vae is not None:
            plan.append(("vae", vae, "decode"))
    elif isinstance(target, nn.Module):
        methods = (methods,) if isinstance(methods, str) else tuple(methods)
        missing = [m for m in methods if not callable(getattr(type(target), m, None))]
        if missing or not methods:
            raise ValueError(f"compile_: {type(target).__name__} has no method(s) {missing or methods}; pass methods= "
                             "naming methods of its class (e.g. ('decode',) for a VAE). Nothing was changed.")
        plan = [(type(target).__name__, target, m) for m in methods]
    else:
        raise TypeError(f"compile_ takes a diffusers pipeline or a torch.nn.Module, not {type(target).__name__}. "
                        "Nothing was changed.")

    # Build everything first, install after: a failure leaves every module as it was (the forwards are built through
    # their Stacks last, and `install_each` sets none until all are built).
    built = [(name, module, method, CompiledMethod(module, method, options))
             for name, module, method in plan if method != "forward"]
    compiled = {}
    denoisers = [(name, module) for name, module, method in plan if method == "forward"]
    stacks = [(module, (installed_stack(module) or Stack()).with_compile(options)) for _, module in denoisers]
    forwards = install_each(stacks)
    for (name, _), (_, stack), forward in zip(denoisers, stacks, forwards):
        runner = unwrapped(forward)
        if stack.cache_config is not None and not isinstance(runner, BlockwiseForward):  # DeepCache's forward, paths
            compiled.update({f"{name}.forward": runner.native, f"{name}.deepcache.full_forward": runner.full_path,
                             f"{name}.deepcache.shallow_forward": runner.shallow_path})
        else:
            compiled[f"{name}.forward"] = forward
    if is_pipeline(target):
        for _, module, _ in plan:
            _conv_weights_channels_last(module)
    if video_vae is not None:
        log.info("Overdrive compile_: %s (%d convolutions).", eager_reason(video_vae),
                 conv_weights_channels_last_(video_vae, nn.Conv3d))
    for name, module, method, made in built:
        setattr(module, method, made)
        compiled[f"{name}.{method}"] = made
    return compiled


def _conv_weights_channels_last(module: nn.Module) -> None:
    """Inductor runs a conv-heavy graph channels-last and, since weights are graph inputs (so that switched or patched
    weights need no recompile), copies every NCHW conv weight into that layout on every call (its own TODO in
    torch/_inductor/kernel/conv.py). Converting them once, in place, saves that traffic at every UNet call. diffusers'
    torch.compile guide does the same. switch_weights_ copies into these tensors, keeping it.
    2-D convolutions only: Wan's patch embedding and video VAE are 3-D, which `module.to(channels_last)` refuses."""
    conv_weights_channels_last_(module, nn.Conv2d)
