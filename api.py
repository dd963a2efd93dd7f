"""The public Python API for diffusers pipelines and bare torch modules (no ComfyUI): see overdrive.diffusers_api.

    from overdrive.api import compile_, quantize_, deepcache_, switch_weights_, attention_, parallelize_
"""
from .diffusers_api import (AttentionConfig, CompileOptions, DeepCacheConfig, ParallelConfig, QuantConfig,
                            WeightMismatchError, attention_, compile_, deepcache_, parallelize_, quantize_,
                            switch_weights_)

__all__ = ["compile_", "quantize_", "deepcache_", "switch_weights_", "attention_", "parallelize_", "CompileOptions",
           "QuantConfig", "DeepCacheConfig", "AttentionConfig", "ParallelConfig", "WeightMismatchError"]
