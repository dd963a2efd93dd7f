"""Built-in fixed-seed checkpoints: single-file SD1.5 and SDXL `.safetensors` that ComfyUI's
CheckpointLoaderSimple detects and loads, generated from plain torch (no ComfyUI import, no model hub).

The weights are random, so images are noise, but every layer of the real architecture runs with finite,
non-degenerate activations. "tiny" shrinks the UNet to the least ComfyUI's detection still accepts (the
text encoders and VAE keep their fixed shapes); "full" is the real SD1.5/SDXL. Another seed gives the same
architecture with other weights.

    from overdrive.builtin_models import ensure_checkpoint
    path = ensure_checkpoint("sdxl", "tiny", seed=0, directory=".../models/checkpoints")

    python -m overdrive.builtin_models --arch sd15 --size tiny --seed 0 --out DIR
"""
from .checkpoint import (ARCHS, DTYPES, GENERATOR_VERSION, SIZES, checkpoint_name, checkpoint_tensors,
                         default_directory, ensure_checkpoint)

__all__ = ["ARCHS", "DTYPES", "GENERATOR_VERSION", "SIZES", "checkpoint_name", "checkpoint_tensors",
           "default_directory", "ensure_checkpoint"]
