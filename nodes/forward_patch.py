"""The diffusion model's forward as Overdrive's nodes replace it, in one place.

Each node installs one ModelPatcher object patch, "diffusion_model.forward", and composes with what it finds there:
a CompiledMethod (Compile Model), a DeepCacheRunner (DeepCache), or a runner whose full and shallow paths and
native forward are compiled (both nodes, in either order). SwitchWeights rebuilds the same patch over a new module.
"""
import hashlib

import torch
from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed
from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

from ..compiler import CompiledMethod
from ..deepcache import DeepCacheRunner
from .progress import comfy_progress

FORWARD = "diffusion_model.forward"


def swapped_layers(model) -> str:
    """The layers `model`'s object patches swap into the diffusion model at load (QuantizeModel's 8-bit layers):
    a model with them compiles to another graph than the same architecture without, so they key the graph."""
    swaps = sorted(f"{key}:{type(value).__name__}" for key, value in model.object_patches.items()
                   if key.startswith("diffusion_model.") and isinstance(value, torch.nn.Module))
    return hashlib.sha256("|".join(swaps).encode()).hexdigest()[:16] if swaps else ""


def compiled(module, method: str, options, model) -> CompiledMethod:
    return CompiledMethod(module, method, options, reporter=comfy_progress, variant=swapped_layers(model))


def compile_options(forward):
    """The CompileOptions a forward patch runs with (for a DeepCacheRunner, those of its native forward), or None."""
    if isinstance(forward, DeepCacheRunner):
        forward = forward.native
    return forward.options if isinstance(forward, CompiledMethod) else None


def compile_paths(runner: DeepCacheRunner, options, model) -> DeepCacheRunner:
    """Route the runner's full and shallow paths through compiled graphs (one per path, shared per architecture)."""
    runner.compile_paths(lambda paths, name: compiled(paths, name, options, model))
    return runner


def deepcache_runner(model, config, native_forward=None, options=None) -> DeepCacheRunner:
    """A runner over the diffusion model of `model` (a ModelPatcher); with `options`, its paths compiled.
    Raises deepcache.UnsupportedUNetError for a diffusion model that is not an openaimodel UNet."""
    base = model.model
    runner = DeepCacheRunner.for_openai_unet(
        base.diffusion_model, config, forward_timestep_embed=forward_timestep_embed,
        timestep_embedding=timestep_embedding, native_forward=native_forward,
        # Read at each run start: a later object patch of model_sampling (ModelSamplingDiscrete) is honoured.
        percent_to_sigma=lambda percent: base.model_sampling.percent_to_sigma(percent))
    return compile_paths(runner, options, model) if options is not None else runner


def compiled_forward(model, options):
    """Compile Model's patch for `model`: its forward compiled; a DeepCache already there is kept, as a copy of
    that runner with its own cache whose paths are compiled too (the input model's runner is left as it was)."""
    forward = compiled(model.model.diffusion_model, "forward", options, model)
    previous = model.object_patches.get(FORWARD)
    if isinstance(previous, DeepCacheRunner):
        return compile_paths(previous.clone(native_forward=forward), options, model)
    return forward


def forward_for(model, previous):
    """`previous`, the forward patch of another model of the same architecture, rebuilt with the same settings over
    `model`'s own diffusion model (SwitchWeights puts new weights in a new module). Other patches are kept as is."""
    options = compile_options(previous)
    unet = model.model.diffusion_model
    if isinstance(previous, DeepCacheRunner):
        native = compiled(unet, "forward", options, model) if options is not None else None
        return deepcache_runner(model, previous.config, native, options)
    return compiled(unet, "forward", options, model) if options is not None else previous
