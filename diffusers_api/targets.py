"""What an API call acts on: a diffusers pipeline's UNet (and VAE), or a bare torch module.

Pipelines are recognised without importing diffusers: an object can only be a diffusers pipeline if diffusers is
already imported. Anything else is refused with a TypeError that says what is supported, before anything changes.
"""
import sys

import torch.nn as nn

SUPPORTED = ("diffusers pipelines with a UNet2DConditionModel `unet` (Stable Diffusion 1.x/2.x, SDXL and their "
             "img2img/inpaint variants), and those with a `transformer` of a known DiT family: "
             "FluxTransformer2DModel (Flux.1), WanTransformer3DModel (Wan 2.1/2.2, both experts of A14B), "
             "QwenImageTransformer2DModel (Qwen-Image), SD3Transformer2DModel (SD3/3.5), "
             "ZImageTransformer2DModel (Z-Image)")


def is_pipeline(target) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(target, diffusers.DiffusionPipeline)


def is_diffusers_unet(module) -> bool:
    return isinstance(module, nn.Module) and any(c.__name__ == "UNet2DConditionModel" for c in type(module).__mro__)


def _components(pipe) -> str:
    return ", ".join(f"{k}={type(v).__name__}" for k, v in getattr(pipe, "components", {}).items()) or "none"


# A DiT pipeline's denoisers. Wan 2.2 A14B has two experts of one architecture: `transformer` for the high-noise steps
# and `transformer_2` for the low-noise ones; each is accelerated, and they share compiled graphs.
DIT_COMPONENTS = ("transformer", "transformer_2")


def pipeline_denoisers(pipe, feature: str) -> list:
    """[(component name, module)]: the pipeline's UNet, or its DiT transformers that a family plug-in knows."""
    from ..families import family_of

    if not is_diffusers_unet(getattr(pipe, "unet", None)):
        transformers = [(name, getattr(pipe, name, None)) for name in DIT_COMPONENTS]
        found = [(name, m) for name, m in transformers if isinstance(m, nn.Module) and family_of(m) is not None]
        if found:
            return found
    return [("unet", pipeline_unet(pipe, feature))]


def pipeline_unet(pipe, feature: str) -> nn.Module:
    unet = getattr(pipe, "unet", None)
    if not is_diffusers_unet(unet):
        raise TypeError(
            f"{feature}: {type(pipe).__name__} has no UNet2DConditionModel `unet` (its components: {_components(pipe)}). "
            f"Supported: {SUPPORTED}. For another denoiser pass the module itself, e.g. {feature}(pipe.transformer, "
            "...), where the feature works on any module. Nothing was changed.")
    return unet


def target_modules(target, feature: str) -> list:
    """[(name, module)] to act on: a pipeline's UNet or DiT transformer(s), or the module itself."""
    if is_pipeline(target):
        return pipeline_denoisers(target, feature)
    if isinstance(target, nn.Module):
        return [(type(target).__name__, target)]
    raise TypeError(f"{feature} takes a diffusers pipeline or a torch.nn.Module, not {type(target).__name__}. "
                    f"Supported pipelines: {SUPPORTED}. Nothing was changed.")


def pipeline_vae(pipe):
    """The pipeline's VAE if it has one with a `decode` method, else None."""
    vae = getattr(pipe, "vae", None)
    return vae if isinstance(vae, nn.Module) and callable(getattr(type(vae), "decode", None)) else None
