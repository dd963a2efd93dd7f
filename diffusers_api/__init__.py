"""Overdrive's core for diffusers pipelines and bare modules, in the style of torchao's `quantize_(model, config)`:
each function changes its target in place, all or nothing, and refuses what it cannot handle with a TypeError.

    from overdrive.api import CompileOptions, DeepCacheConfig, QuantConfig
    from overdrive.api import compile_, deepcache_, quantize_, switch_weights_

    quantize_(pipe, QuantConfig(), calibration={"prompt": "a cat", "height": 1024, "width": 1024})
    compile_(pipe, CompileOptions())              # UNet forward + VAE decode, graphs shared per architecture
    deepcache_(pipe, DeepCacheConfig(cache_interval=3))
    switch_weights_(pipe, "finetune.safetensors")  # same architecture: no recompile

Supported pipelines: those with a diffusers UNet2DConditionModel `unet` (SD1.x/2.x, SDXL). compile_, quantize_ and
switch_weights_ also take any torch.nn.Module; deepcache_ takes a UNet2DConditionModel.
"""
from ..compiler import CompileOptions, WeightMismatchError
from ..deepcache import DeepCacheConfig
from ..quantization import QuantConfig
from .compile import compile_
from .deepcache import deepcache_
from .quantize import quantize_
from .switch import switch_weights_

__all__ = ["compile_", "quantize_", "deepcache_", "switch_weights_", "CompileOptions", "QuantConfig",
           "DeepCacheConfig", "WeightMismatchError"]
