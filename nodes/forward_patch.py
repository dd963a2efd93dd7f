"""The diffusion model's forward as Overdrive's nodes replace it, in one place.

Each node installs one ModelPatcher object patch, "diffusion_model.forward", and composes with what it finds there.
SD UNets: a CompiledMethod (Compile Model), a DeepCacheRunner (DeepCache), or a runner whose full and shallow paths
and native forward are compiled (both nodes, in either order). Families with a plug-in (families/: the DiTs): one
BlockwiseForward that holds both the compiled blocks and the step cache. SwitchWeights rebuilds the same patch over
a new module.
"""
import hashlib

import torch
from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed
from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

from ..blockwise import BlockwiseForward
from ..compiler import CompiledMethod
from ..deepcache import DeepCacheRunner
from ..families import family_of
from .progress import comfy_progress

FORWARD = "diffusion_model.forward"


def swapped_layers(model, prefix: str = "diffusion_model.") -> str:
    """The layers `model`'s object patches swap in under `prefix` at load (QuantizeModel's 8-bit layers): a module
    with them compiles to another graph than the same architecture without, so they key the graph."""
    swaps = sorted(f"{key[len(prefix):]}:{type(value).__name__}" for key, value in model.object_patches.items()
                   if key.startswith(prefix) and isinstance(value, torch.nn.Module))
    return hashlib.sha256("|".join(swaps).encode()).hexdigest()[:16] if swaps else ""


def compiled(module, method: str, options, model) -> CompiledMethod:
    return CompiledMethod(module, method, options, reporter=comfy_progress, variant=swapped_layers(model))


def block_compiler(model):
    """How a BlockwiseForward of `model` compiles one block: keyed by the layers a load swaps into that block."""
    def compile_block(block, path, options):
        return CompiledMethod(block, "forward", options, reporter=comfy_progress, announce=False,
                              variant=swapped_layers(model, f"diffusion_model.{path}."))
    return compile_block


def blockwise(model, family, options=None, cache=None) -> BlockwiseForward:
    base = model.model
    return BlockwiseForward(base.diffusion_model, family, options, cache, block_compiler(model),
                            percent_to_sigma=lambda percent: base.model_sampling.percent_to_sigma(percent))


def compile_options(forward):
    """The CompileOptions a forward patch runs with (for a DeepCacheRunner, those of its native forward), or None."""
    if isinstance(forward, DeepCacheRunner):
        forward = forward.native
    return forward.options if isinstance(forward, (CompiledMethod, BlockwiseForward)) else None


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
    previous = model.object_patches.get(FORWARD)
    family = family_of(model.model.diffusion_model)
    if family is not None:
        cache = previous.cache_config if isinstance(previous, BlockwiseForward) else None
        return blockwise(model, family, options, cache)
    forward = compiled(model.model.diffusion_model, "forward", options, model)
    if isinstance(previous, DeepCacheRunner):
        return compile_paths(previous.clone(native_forward=forward), options, model)
    return forward


def forward_for(model, previous):
    """`previous`, the forward patch of another model of the same architecture, rebuilt with the same settings over
    `model`'s own diffusion model (SwitchWeights puts new weights in a new module). Other patches are kept as is."""
    options = compile_options(previous)
    unet = model.model.diffusion_model
    if isinstance(previous, BlockwiseForward):
        return blockwise(model, previous.family, options, previous.cache_config)
    if isinstance(previous, DeepCacheRunner):
        native = compiled(unet, "forward", options, model) if options is not None else None
        return deepcache_runner(model, previous.config, native, options)
    return compiled(unet, "forward", options, model) if options is not None else previous
