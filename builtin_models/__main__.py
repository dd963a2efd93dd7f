"""python -m overdrive.builtin_models --arch sd15 --size tiny --seed 0 --out DIR  (prints the file's path)"""
import argparse

from .checkpoint import ARCHS, DTYPES, SIZES, ensure_checkpoint


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write (or find cached) a built-in fixed-seed checkpoint.")
    parser.add_argument("--arch", choices=ARCHS, default="sd15")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--out", default=None, help="folder (default: $OVERDRIVE_CACHE_DIR/checkpoints)")
    args = parser.parse_args(argv)
    print(ensure_checkpoint(args.arch, args.size, args.seed, args.out, DTYPES[args.dtype]))


if __name__ == "__main__":
    main()
