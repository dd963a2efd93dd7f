"""Inside ComfyUI, Overdrive's caches live beside the user's models (OVERDRIVE_CACHE_DIR overrides)."""
import os

import folder_paths

from ..core.storage import cache_dir


def comfy_cache_dir(kind: str):
    """`<ComfyUI models>/overdrive_cache/<kind>`, or `$OVERDRIVE_CACHE_DIR/<kind>`."""
    return cache_dir(kind, os.path.join(folder_paths.models_dir, "overdrive_cache"))
