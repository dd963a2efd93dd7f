"""The public Python API for diffusers pipelines and bare torch modules (no ComfyUI): see overdrive.diffusers_api.

    from overdrive.api import compile_, quantize_, deepcache_, switch_weights_, attention_, parallelize_
"""
from .diffusers_api import *  # noqa: F401,F403 - the names diffusers_api.__all__ lists
from .diffusers_api import __all__  # noqa: F401
