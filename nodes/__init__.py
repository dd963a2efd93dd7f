"""ComfyUI node registrations. Each node is a thin adapter over the core packages."""
import os

import folder_paths

from ..compiler import CompileDiskCache, set_disk_cache
from .compile_nodes import OverdriveCompileModel, OverdriveCompileVAE
from .deepcache_node import OverdriveDeepCache
from .quantize_node import OverdriveQuantizeModel
from .switch_weights_node import OverdriveSwitchWeights

NODE_CLASS_MAPPINGS = {
    "OverdriveCompileModel": OverdriveCompileModel,
    "OverdriveCompileVAE": OverdriveCompileVAE,
    "OverdriveSwitchWeights": OverdriveSwitchWeights,
    "OverdriveDeepCache": OverdriveDeepCache,
    "OverdriveQuantizeModel": OverdriveQuantizeModel,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "OverdriveCompileModel": "Compile Model (Overdrive)",
    "OverdriveCompileVAE": "Compile VAE (Overdrive)",
    "OverdriveSwitchWeights": "Switch Weights (Overdrive)",
    "OverdriveDeepCache": "DeepCache (Overdrive)",
    "OverdriveQuantizeModel": "Quantize Model (Overdrive)",
}

# Compiled artifacts live beside the user's models (OVERDRIVE_CACHE_DIR overrides), so they survive restarts.
if "OVERDRIVE_CACHE_DIR" not in os.environ:
    set_disk_cache(CompileDiskCache(os.path.join(folder_paths.models_dir, "overdrive_cache", "compiled")))
