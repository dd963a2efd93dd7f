"""The public Python API for diffusers pipelines and bare torch modules (no ComfyUI): see overdrive.diffusers_api.

    from overdrive.api import compile_, quantize_, deepcache_, switch_weights_
"""
from .diffusers_api import (CompileOptions, DeepCacheConfig, QuantConfig, WeightMismatchError, compile_, deepcache_,
                            quantize_, switch_weights_)

__all__ = ["compile_", "quantize_", "deepcache_", "switch_weights_", "CompileOptions", "QuantConfig",
           "DeepCacheConfig", "WeightMismatchError"]
