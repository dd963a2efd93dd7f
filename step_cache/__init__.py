"""DeepCache for UNet diffusion models (plain torch; no ComfyUI import).

Skips the deep part of the UNet on most sampling steps and reuses the deep feature recorded at the last full step
(Ma et al., "DeepCache: Accelerating Diffusion Models for Free", 2023).

    from overdrive.step_cache import DeepCacheConfig, DeepCacheRunner
    runner = DeepCacheRunner.for_openai_unet(unet, DeepCacheConfig(cache_interval=3, cache_depth=1),
                                             forward_timestep_embed=..., timestep_embedding=...,
                                             percent_to_sigma=model_sampling.percent_to_sigma)
    out = runner(x, timesteps, context=..., transformer_options={"sigmas": sigmas, "cond_or_uncond": [1, 0]})

In ComfyUI the runner replaces the UNet's forward through a ModelPatcher object patch (see nodes/).
"""
from .cache import FeatureCache
from .config import DeepCacheConfig, DeepCacheConfigError
from .paths import CallInfo, UNetPaths
from .runner import DeepCacheRunner, DeepCacheUnsupportedError
from .schedule import DeepCacheSchedule, RunStats, StepDecision
from .unet_diffusers import DiffusersUNetPaths
from .unet_openai import OpenAIUNetPaths, UnsupportedUNetError

__all__ = [
    "DeepCacheConfig", "DeepCacheConfigError", "DeepCacheRunner", "DeepCacheUnsupportedError", "DeepCacheSchedule",
    "RunStats", "StepDecision", "FeatureCache", "CallInfo", "UNetPaths", "OpenAIUNetPaths", "UnsupportedUNetError",
    "DiffusersUNetPaths",
]
