"""What an API call acts on: a diffusers pipeline's UNet (and VAE), or a bare torch module.

Pipelines are recognised without importing diffusers: an object can only be a diffusers pipeline if diffusers is
already imported. Anything else is refused with a TypeError that says what is supported, before anything changes.
"""
import sys

import torch.nn as nn

SUPPORTED = ("diffusers pipelines with a UNet2DConditionModel `unet` (Stable Diffusion 1.x/2.x, SDXL and their "
             "img2img/inpaint variants), and those with a `transformer` of a known DiT family: "
             "FluxTransformer2DModel (Flux.1), WanTransformer3DModel (Wan 2.1/2.2), QwenImageTransformer2DModel "
             "(Qwen-Image), SD3Transformer2DModel (SD3/3.5), ZImageTransformer2DModel (Z-Image)")


def is_pipeline(target) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(target, diffusers.DiffusionPipeline)


def is_diffusers_unet(module) -> bool:
    return isinstance(module, nn.Module) and any(c.__name__ == "UNet2DConditionModel" for c in type(module).__mro__)


def _components(pipe) -> str:
    return ", ".join(f"{k}={type(v).__name__}" for k, v in getattr(pipe, "components", {}).items()) or "none"


def pipeline_denoiser(pipe, feature: str) -> tuple:
    """(component name, module): the pipeline's UNet, or its DiT transformer where a family plug-in knows it."""
    from ..families import family_of

    transformer = getattr(pipe, "transformer", None)
    if not is_diffusers_unet(getattr(pipe, "unet", None)) and isinstance(transformer, nn.Module) \
            and family_of(transformer) is not None:
        return "transformer", transformer
    return "unet", pipeline_unet(pipe, feature)


def pipeline_unet(pipe, feature: str) -> nn.Module:
    unet = getattr(pipe, "unet", None)
    if not is_diffusers_unet(unet):
        raise TypeError(
            f"{feature}: {type(pipe).__name__} has no UNet2DConditionModel `unet` (its components: {_components(pipe)}). "
            f"Supported: {SUPPORTED}. For another denoiser pass the module itself, e.g. {feature}(pipe.transformer, "
            "...), where the feature works on any module. Nothing was changed.")
    return unet


def target_module(target, feature: str) -> nn.Module:
    """The module to act on: a pipeline's UNet or DiT transformer, or the module itself."""
    if is_pipeline(target):
        return pipeline_denoiser(target, feature)[1]
    if isinstance(target, nn.Module):
        return target
    raise TypeError(f"{feature} takes a diffusers pipeline or a torch.nn.Module, not {type(target).__name__}. "
                    f"Supported pipelines: {SUPPORTED}. Nothing was changed.")


def pipeline_vae(pipe):
    """The pipeline's VAE if it has one with a `decode` method, else None."""
    vae = getattr(pipe, "vae", None)
    return vae if isinstance(vae, nn.Module) and callable(getattr(type(vae), "decode", None)) else None
