"""Does max-autotune speed up a DiT's fp8 MLP? No: within noise, for 100-200 s of compiling (2026-11-27_h100_fp8_mlp_autotune.json).

The MLP (fp8 GEMM, tanh-GELU, e4m3 cast, fp8 GEMM) of Overdrive's own layers compiled by default and with
max-autotune, with and without persistent TMA templates: time, error, the kernels autotuning chose.
Analysis: bench/experiments/flux2-chroma-fp8-error.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/fp8_mlp_autotune.py --out bench/results/DATE_GPU_fp8_mlp.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from overdrive.compiler.activations import tanh_gelu_via_sigmoid
from overdrive.quantization import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, beside probes/
from report import environment  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (rows, model width, MLP width)
    "qwen_image_1328_cfg": (2 * 6889, 3072, 12288),
    "flux_1024_double_block_img": (4096, 3072, 12288),
    "wan22_5b_480p_33f_cfg": (2 * 3510, 3072, 14336),
}
VARIANTS = {  # name: (torch.compile mode, Inductor settings); every variant compiles cold (no code shared)
    "default": ("default", {}),
    "max-autotune": ("max-autotune-no-cudagraphs", {}),
    "max-autotune-tma": ("max-autotune-no-cudagraphs", {"triton.enable_persistent_tma_matmul": True}),
}


def mlp(xq, x_scale, w1, w1_scale, b1, inner_scale, inner_inverse, w2, w2_scale, b2):
    hidden = kernels.fp8_gemm(xq, x_scale, w1, w1_scale, b1, torch.bfloat16)
    return kernels.fp8_linear(tanh_gelu_via_sigmoid(hidden), w2, w2_scale, b2, torch.bfloat16,
                              x_scale=inner_scale, x_inverse_scale=inner_inverse)


def weight(rows, cols, gen):
    w = torch.randn(rows, cols, device="cuda", generator=gen) / cols ** 0.5
    scale = w.abs().amax() / kernels.FP8_MAX
    return (w / scale).to(FP8), scale.reshape(1, 1)


def kernel_times(fn, args):
    """[(kernel name, us)] of one call, largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(((name[:90], round(us, 1)) for name, us in events), key=lambda e: -e[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the first is the error's reference")
    args = parser.parse_args()
    result = {**environment(), "timing": "triton.testing.do_bench median", "shapes": {}}
    for name in args.shapes.split(","):
        rows, width, hidden = SHAPES[name]
        gen = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(rows, width, device="cuda", generator=gen)
        x_scale = (x.abs().amax() / kernels.FP8_MAX).reshape(1, 1)
        w1, s1 = weight(hidden, width, gen)
        w2, s2 = weight(width, hidden, gen)
        b1 = torch.randn(hidden, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
        b2 = torch.randn(width, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
        inner = torch.tensor([[4.0 / kernels.FP8_MAX]], device="cuda")
        inputs = ((x / x_scale).to(FP8), x_scale, w1, s1, b1, inner, 1 / inner, w2, s2, b2)
        flop = 2 * rows * width * hidden * 2
        entry, reference = {"rows": rows, "width": width, "hidden": hidden, "flop": flop}, None
        for label in args.variants.split(","):
            mode, settings = VARIANTS[label]
            torch._dynamo.reset()
            with torch._inductor.config.patch({"force_disable_caches": True, **settings}):
                fn = torch.compile(mlp, mode=mode, dynamic=False)
                start = time.perf_counter()
                out = fn(*inputs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                ms = do_bench(lambda: fn(*inputs), return_mode="median")
                top = kernel_times(fn, inputs)
            out = out.float()
            reference = out if reference is None else reference
            err = ((out - reference).norm() / reference.norm()).item()
            entry[label] = {"ms": ms, "TFLOP_per_s": flop / ms / 1e9, "compile_s": compile_s, "rel_err": err,
                            "kernels_us": top[:6]}
            print(f"{name} | {label}: {ms * 1e3:.1f} us, {flop / ms / 1e9:.0f} TFLOP/s, compile {compile_s:.1f} s, "
                  f"err {err:.2e} | {top[:4]}", flush=True)
        result["shapes"][name] = entry
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
