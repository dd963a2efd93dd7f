"""Which graph-level levers would put Overdrive's compiled SDXL UNet ahead of plain torch.compile per call (GPU).

Issue 9 asks for Overdrive's compile to be ahead of the peer per image; until now both ran the same Inductor graph (GPU
busy within 1 %). This measures, per UNet call (SDXL config, fixed-seed random weights, 1024² latent, CFG batch 2) and
per VAE decode, what each lever changes on its own and together, in one process:
  fuse   q/k/v (and cross-attention k/v) projections as one GEMM each (diffusers' fuse_qkv_projections)
  cdt    Inductor's coordinate-descent tuning of its Triton kernels' block sizes (tuned at the first call)
  cudnn  torch.backends.cudnn.benchmark: cuDNN times its conv algorithms for each shape instead of guessing

  python bench/bench_unet_levers.py --out bench/results/DATE_h100_unet_levers.json
  python bench/bench_unet_levers.py --tiny --device cpu --variants eager,od,od+fuse      # smoke test

Timing: `--calls` calls enqueued back to back between two CUDA events (Overdrive's and the peer's CUDA-graph replays;
the host runs ahead, so this is the GPU's time per call), after 3 warm-up calls. Inductor's caches start empty in a
temp folder; variants after the first reuse kernels they share with it, so compile times are only comparable in order.
"""
import argparse
import gc
import json
import os
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_diffusers import SDXL_VAE, TINY_VAE, build_unet  # noqa: E402
from report import environment, finish, write_report  # noqa: E402

LEVERS = ("fuse", "cdt", "cudnn")
VARIANTS = ("eager", "od", "od+cudnn", "od+fuse", "od+fuse+cudnn", "od+cdt", "od+fuse+cdt+cudnn", "peer",
            "vae-eager", "vae-od", "vae-od+cudnn", "vae-peer")


def unet_inputs(args):
    side, (tokens, width, pooled) = (16, (8, 64, 32)) if args.tiny else (128, (77, 2048, 1280))
    g = torch.Generator().manual_seed(args.seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(args.device, args.dtype)  # noqa: E731
    time_ids = torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]] * 2, dtype=args.dtype, device=args.device)
    return (make(2, 4, side, side), torch.tensor([500.0, 500.0], device=args.device)), {
        "encoder_hidden_states": make(2, tokens, width),
        "added_cond_kwargs": {"text_embeds": make(2, pooled), "time_ids": time_ids}}


def build_vae(args):
    from diffusers import AutoencoderKL
    torch.manual_seed(args.seed + 1)
    with torch.device(args.device):
        vae = AutoencoderKL(**(TINY_VAE if args.tiny else SDXL_VAE))
    return vae.to(args.dtype).eval().requires_grad_(False)


def install(variant, args):
    """The model, with `variant`'s levers applied, and the callable to time."""
    from overdrive.api import CompileOptions, compile_
    parts = variant.replace("vae-", "").split("+")
    vae = variant.startswith("vae-")
    model = build_vae(args) if vae else build_unet(args)
    if "fuse" in parts:
        model.fuse_qkv_projections()
    torch.backends.cudnn.benchmark = "cudnn" in parts
    torch._inductor.config.coordinate_descent_tuning = "cdt" in parts
    backend = "eager" if args.tiny and args.device == "cpu" else "inductor"
    if parts[0] == "peer":  # diffusers' torch.compile guide: channels-last weights, reduce-overhead, fullgraph
        model.to(memory_format=torch.channels_last)
        kwargs = {"mode": "reduce-overhead"} if backend == "inductor" else {}
        compiled = torch.compile(model.decode if vae else model, fullgraph=True, backend=backend, **kwargs)
    elif parts[0] == "od":
        model.to(memory_format=torch.channels_last)  # what compile_ does for a pipeline's UNet and VAE
        compile_(model, CompileOptions(backend=backend, cuda_graphs=args.device == "cuda"),
                 methods=("decode",) if vae else ("forward",))
        compiled = model.decode if vae else model
    else:
        compiled = model.decode if vae else model

    def call(inputs):
        if parts[0] == "peer" and args.device == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        args_, kwargs_ = inputs
        out = compiled(*args_, **kwargs_, return_dict=False)[0]
        return out
    return model, call


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def measure(variant, args, inputs, reference):
    model, call = install(variant, args)
    start = time.perf_counter()
    with torch.inference_mode():
        out = call(inputs).float().cpu()
        sync(args)
        first = time.perf_counter() - start
        for _ in range(3):
            call(inputs)
        sync(args)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.calls):
                call(inputs)
            end.record()
            end.synchronize()
            per_call = begin.elapsed_time(end) / 1e3 / args.calls
        else:
            start = time.perf_counter()
            for _ in range(args.calls):
                call(inputs)
            per_call = (time.perf_counter() - start) / args.calls
    error = None if reference is None else float((out.double() - reference.double()).norm() / reference.double().norm())
    row = {"variant": variant, "ms_per_call": round(per_call * 1e3, 3), "first_call_s": round(first, 2),
           "rel_err_vs_eager": error,
           "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if args.device == "cuda" else None}
    del model, call
    return row, out


def reset():
    from overdrive.compiler import clear_shared_graphs
    torch._dynamo.reset()
    clear_shared_graphs()
    torch.backends.cudnn.benchmark = False
    torch._inductor.config.coordinate_descent_tuning = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny SDXL-shaped UNet/VAE: smoke test of the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype = torch.float16 if args.device == "cuda" else torch.float32
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    cache = tempfile.mkdtemp(prefix="overdrive-levers-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["OVERDRIVE_CACHE_DIR"] = cache
    import diffusers
    unet_in = unet_inputs(args)
    side = 16 if args.tiny else 128
    vae_in = ((torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(args.seed))
               .to(args.device, args.dtype),), {})
    report = {"benchmark": "unet_levers", "settings": {k: str(v) for k, v in vars(args).items()},
              "environment": dict(environment(), diffusers=diffusers.__version__),
              "shapes": "UNet: SDXL config, latent 2x4x128x128 (1024², CFG batch 2), 77x2048 context; VAE: decode "
                        "1x4x128x128 to 1024²", "results": []}
    references = {}
    for variant in variants:
        vae = variant.startswith("vae-")
        reference = references.get(vae)
        row, out = measure(variant, args, vae_in if vae else unet_in, reference)
        if variant in ("eager", "vae-eager"):
            references[vae] = out
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        write_report(report, args.out)
        reset()
    finish(report, report["results"], [("variant", lambda r: r["variant"]), ("ms/call", lambda r: r["ms_per_call"]),
                                       ("first call (s)", lambda r: r["first_call_s"]),
                                       ("rel err vs eager", lambda r: r["rel_err_vs_eager"]),
                                       ("peak VRAM GiB", lambda r: r["peak_vram_gib"])], args.out)


if __name__ == "__main__":
    main()
