"""The public Python API for diffusers pipelines and bare torch modules (no ComfyUI): see overdrive.diffusers_api.

    from overdrive.api import compile_, quantize_, deepcache_, switch_weights_, attention_
"""
from .diffusers_api import (AttentionConfig, CompileOptions, DeepCacheConfig, QuantConfig, WeightMismatchError,
                            attention_, compile_, deepcache_, quantize_, switch_weights_)

__all__ = ["compile_", "quantize_", "deepcache_", "switch_weights_", "attention_", "CompileOptions", "QuantConfig",
           "DeepCacheConfig", "AttentionConfig", "WeightMismatchError"]
