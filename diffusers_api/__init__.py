"""Overdrive's core for diffusers pipelines and bare modules, in the style of torchao's `quantize_(model, config)`:
each function changes its target in place, all or nothing, and refuses what it cannot handle with a TypeError.

    from overdrive.api import AttentionConfig, CompileOptions, DeepCacheConfig, QuantConfig
    from overdrive.api import attention_, compile_, deepcache_, quantize_, switch_weights_

    quantize_(pipe, QuantConfig(), calibration={"prompt": "a cat", "height": 1024, "width": 1024})
    compile_(pipe, CompileOptions())              # UNet forward + VAE decode, graphs shared per architecture
    deepcache_(pipe, DeepCacheConfig())  # auto: a UNet's DeepCache at interval 3, a DiT's calibrated step cache
    switch_weights_(pipe, "finetune.safetensors")  # same architecture: no recompile
    attention_(pipe, AttentionConfig(mode="auto"))  # the fastest attention kernel within the error bound, per shape
    parallelize_(pipe, ParallelConfig(mode="auto"))  # under torchrun: each call over every process's GPU

Supported pipelines: those with a diffusers UNet2DConditionModel `unet` (SD1.x/2.x, SDXL), and those with a DiT
`transformer` of a known family (Flux.1, Wan 2.1/2.2, Qwen-Image, SD3/3.5, Z-Image: families/), compiled block by
block and step-cached per block stack. compile_, quantize_, switch_weights_ and attention_ also take any
torch.nn.Module; deepcache_ takes a UNet2DConditionModel or a family's transformer.
"""
from ..attention.choice import AttentionConfig
from ..compiler import CompileOptions, WeightMismatchError
from ..step_cache import DeepCacheConfig
from ..parallel.config import ParallelConfig
from ..quantization import QuantConfig
from .attention import attention_
from .compile import compile_
from .deepcache import deepcache_
from .parallelize import parallelize_
from .quantize import quantize_
from .switch import switch_weights_

__all__ = ["compile_", "quantize_", "deepcache_", "switch_weights_", "attention_", "parallelize_", "CompileOptions",
           "QuantConfig", "DeepCacheConfig", "AttentionConfig", "ParallelConfig", "WeightMismatchError"]
