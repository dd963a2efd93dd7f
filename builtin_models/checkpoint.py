"""Single-file SD1.5/SDXL checkpoints in the original LDM/SGM key layout, cached by a hash of everything
that decides their bytes."""
import hashlib
import json
import os
import pathlib
from typing import Optional, Union

import torch

from ..core.storage import cache_dir
from .clip import CLIP_BIGG, CLIP_L, clip_l_tensors, open_clip_tensors
from .tensors import Specs, with_prefix
from .unet import unet_config, unet_tensors
from .vae import vae_tensors
from .weights import make_tensor
from .writer import DTYPE_NAMES, write_safetensors

# Bump when weights.py or the writer change what the same spec produces: cached files are then remade.
GENERATOR_VERSION = 1
ARCHS, SIZES = ("sd15", "sdxl"), ("tiny", "full")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def checkpoint_tensors(arch: str, size: str) -> Specs:
    """Every tensor of the checkpoint under the prefixes ComfyUI's loader looks for (comfy/supported_models.py)."""
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"arch must be one of {ARCHS} and size one of {SIZES}, not {arch!r}/{size!r}")
    unet = with_prefix("model.diffusion_model.", unet_tensors(unet_config(arch, size)))
    vae = with_prefix("first_stage_model.", vae_tensors())
    if arch == "sd15":
        return unet + with_prefix("cond_stage_model.transformer.", clip_l_tensors(**CLIP_L)) + vae
    return (unet + with_prefix("conditioner.embedders.0.transformer.", clip_l_tensors(**CLIP_L))
            + with_prefix("conditioner.embedders.1.model.", open_clip_tensors(**CLIP_BIGG)) + vae)


def default_directory() -> pathlib.Path:
    return cache_dir("checkpoints")


def checkpoint_name(arch: str, size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float16) -> str:
    """`overdrive-<arch>-<size>-s<seed>-<hash8>.safetensors`; the hash covers the generator version and the
    full tensor list, so editing a shape anywhere names a new file instead of reusing a stale one."""
    spec = [GENERATOR_VERSION, arch, size, seed, DTYPE_NAMES[dtype], checkpoint_tensors(arch, size)]
    digest = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:8]
    return f"overdrive-{arch}-{size}-s{seed}-{digest}.safetensors"


def ensure_checkpoint(arch: str, size: str = "tiny", seed: int = 0,
                      directory: Optional[Union[str, os.PathLike]] = None,
                      dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """The checkpoint's path in `directory` (default: $OVERDRIVE_CACHE_DIR/checkpoints or
    ~/.cache/overdrive/checkpoints), generated first if it is not there yet. Same arguments, same bytes."""
    directory = pathlib.Path(directory) if directory else default_directory()
    path = directory / checkpoint_name(arch, size, seed, dtype)
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    specs = {s.key: s for s in checkpoint_tensors(arch, size)}
    write_safetensors(path, [(s.key, s.shape) for s in specs.values()], dtype,
                      make=lambda key: make_tensor(specs[key], seed, dtype),
                      metadata={"overdrive_generated": f"{arch}/{size}/{seed}",
                                "overdrive_generator_version": str(GENERATOR_VERSION)})
    return path
