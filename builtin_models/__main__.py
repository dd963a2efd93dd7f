"""python -m overdrive.builtin_models --arch sd15 --size tiny --seed 0 --out DIR  (prints the file's path)

For a DiT family (--arch flux|qwen_image|wan22|zimage|sd35) it writes the diffusion-model file and the VAE file
(for models/diffusion_models and models/vae) and prints both paths; their layout is read off ComfyUI's classes, so
ComfyUI must be set up (scripts/install.sh, or COMFYUI_PATH)."""
import argparse
import pathlib

from .checkpoint import ARCHS, DTYPES, SIZES, ensure_checkpoint
from .dit import FAMILIES


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write (or find cached) a built-in fixed-seed checkpoint.")
    parser.add_argument("--arch", choices=[*ARCHS, *FAMILIES], default="sd15")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 for SD, bf16 for DiT families")
    parser.add_argument("--out", default=None, help="folder (default: $OVERDRIVE_CACHE_DIR/checkpoints, .../dit)")
    args = parser.parse_args(argv)
    if args.arch in FAMILIES:
        import torch

        from ..harness.inprocess import import_comfy
        from .dit import default_directory, ensure_diffusion_model, ensure_vae
        import_comfy(cpu=not torch.cuda.is_available())
        dtype, folder = DTYPES[args.dtype or "bf16"], pathlib.Path(args.out) if args.out else default_directory()
        print(ensure_diffusion_model(args.arch, args.size, args.seed, folder, dtype))
        print(ensure_vae(args.arch, args.size, args.seed, folder, dtype))
    else:
        print(ensure_checkpoint(args.arch, args.size, args.seed, args.out, DTYPES[args.dtype or "fp16"]))


if __name__ == "__main__":
    main()
