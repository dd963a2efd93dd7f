"""Built-in checkpoints: fixed-seed SD1.5/SDXL single-file checkpoints that CheckpointLoaderSimple detects,
written by ComfyUI's own classes and its own `save_checkpoint` (so the key layout is exactly what it loads).

No model hub is reachable, and none is needed: the weights are random, so images are noise-like, but every
layer, shape and code path of the real architecture runs. "tiny" keeps what ComfyUI's detection requires
(model_channels 320, context_dim, transformer depths for SDXL) and shrinks the rest; "full" is the real size.

  python -m overdrive.runner.checkpoints --arch sd15 --size tiny --out DIR
"""
import argparse
import hashlib
import json
import os
import pathlib

import torch

from .inprocess import UNET_CONFIGS, TINY, build_model, build_vae, import_comfy, seeded_init_

GENERATOR_VERSION = 1


def default_directory() -> pathlib.Path:
    return pathlib.Path(os.environ.get("OVERDRIVE_CACHE_DIR", pathlib.Path.home() / ".cache" / "overdrive")) / "checkpoints"


def checkpoint_name(arch: str, size: str, seed: int) -> str:
    spec = json.dumps([GENERATOR_VERSION, arch, size, seed, UNET_CONFIGS[arch], TINY[arch]], sort_keys=True)
    return f"overdrive-{arch}-{size}-s{seed}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}.safetensors"


@torch.no_grad()  # as inside ComfyUI's executor: its layers initialise in place
def ensure_checkpoint(arch: str = "sd15", size: str = "tiny", seed: int = 0, directory=None) -> pathlib.Path:
    """The checkpoint's path, generating it first if it is not there yet (atomic: temp file, then rename)."""
    directory = pathlib.Path(directory) if directory else default_directory()
    path = directory / checkpoint_name(arch, size, seed)
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    comfy = import_comfy(cpu=not torch.cuda.is_available())
    import comfy.sd

    model = build_model(comfy, arch, size, torch.float16, seed=seed)
    clip = comfy.sd.CLIP(target=model.model.model_config.clip_target())
    seeded_init_(clip.cond_stage_model, seed + 1)
    clip.cond_stage_model.half()
    vae = build_vae(comfy, seed + 2)
    vae.first_stage_model.half()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        comfy.sd.save_checkpoint(str(tmp), model, clip, vae,
                                 metadata={"overdrive_generated": f"{arch}/{size}/seed {seed}"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(UNET_CONFIGS), default="sd15")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder (default: $OVERDRIVE_CACHE_DIR/checkpoints)")
    args = parser.parse_args()
    print(ensure_checkpoint(args.arch, args.size, args.seed, args.out))


if __name__ == "__main__":
    main()
