"""GPU benchmark of the quantized GEMMs: fp16 F.linear vs Int8Linear vs Fp8Linear on SDXL-like linear shapes,
eager and under torch.compile, plus the relative error of each and the time `quantize_` takes to calibrate them.

  python bench/bench_quantize.py --out bench/results/$(date +%F)_h100_quantize.json

Standalone (no ComfyUI). Times come from CUDA graphs of 10 calls replayed 5 times (the timing QuantizeModel's
`min_speedup` rule uses, `overdrive.quantization.speed`): launch overhead does not count, as under a compiled model
with CUDA graphs. (An earlier version used `triton.testing.do_bench`, which at these sizes measured mostly
launches.) `raw` rows time the bare 8-bit GEMM on already quantized inputs: what the kernels could give if the
activation quantization and rescale were free. Shapes are the SDXL UNet's at 1024²,
batch 2 (CFG): 4096 tokens x 2 at the 640-channel level, 1024 x 2 at the 1280-channel level, and the M = 2 time
embedding (padding path of _int_mm). `--m` forces one M for every shape. "fp8_e4m3 static" is the fp8 layer with a
static activation scale (QuantizeModel's default): its compiled rows also time the layer behind a GELU
(`compiled_gelu_ms`, as in the model, where every linear has a producer) so that the cast's fusion into the producer
shows. Compiled variants stop when
`--budget-s` is spent (default 150 s), so the whole run stays under ~3 minutes of GPU time.
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from report import environment
from overdrive.quantization import kernels
from overdrive.quantization.kernels import INT_MM_MIN_ROWS
from overdrive.quantization import (Fp8Linear, Int8Linear, QuantConfig, fp8_supported, int8_supported,
                                    linear_density, normalised_mse, plan_quantization)

# (name, M, K, N): SDXL 1024², batch 2
SHAPES = [
    ("temb 320->1280 (M=2)", 2, 320, 1280),
    ("attn qkvo 640", 8192, 640, 640),
    ("ff GEGLU in 640->5120", 8192, 640, 5120),
    ("ff out 2560->640", 8192, 2560, 640),
    ("attn qkvo 1280", 2048, 1280, 1280),
    ("ff GEGLU in 1280->10240", 2048, 1280, 10240),
    ("ff out 5120->1280", 2048, 5120, 1280),
]
QUICK = {"temb 320->1280 (M=2)", "attn qkvo 640", "ff GEGLU in 640->5120", "ff GEGLU in 1280->10240"}


def bench_ms(fn, smoke=False):
    if smoke:  # CPU logic check only: a plain median of a few calls
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from overdrive.quantization.speed import graph_seconds, warm_up
    warm_up(fn)
    try:
        return graph_seconds(fn) * 1e3
    except RuntimeError as error:  # e.g. something that cannot be captured: time it plainly, and say so
        print(f"    (not capturable: {str(error).splitlines()[0][:120]}; timed with do_bench)")
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def raw_gemm(fmt, x, module):
    """The bare 8-bit GEMM of `module` on pre-quantized inputs (no activation quantization, no rescale)."""
    if fmt == "int8":
        xq, _ = kernels.quantize_rows_int8(x)
        return lambda: torch._int_mm(xq, module.weight_q.t())
    xq, xs = kernels.quantize_tensor_fp8(x)
    return lambda: torch._scaled_mm(xq, module.weight_q.t(), xs.reshape(()), module.weight_scale.reshape(()),
                                    out_dtype=x.dtype, use_fast_accum=True)


def rel_error(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--m", type=int, default=None, help="use this M (rows) for every shape")
    parser.add_argument("--quick", action="store_true", help="4 shapes instead of 7")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--mode", default="default", help="torch.compile mode (default: 'default')")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop compiling new variants after this")
    parser.add_argument("--formats", default="int8,fp8_e4m3")
    parser.add_argument("--static-only", action="store_true", help="fp16 and fp8 with static scales only (QuantizeModel's "
                        "fp8 layers): fewer compiles, e.g. under --mode max-autotune")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check with tiny shapes (no timings to keep)")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench_quantize.py needs an NVIDIA GPU (CUDA); nothing to measure on this machine.")
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    formats = [f for f in args.formats.split(",") if f]
    usable = {"int8": int8_supported(device), "fp8_e4m3": fp8_supported(device)}
    for fmt in formats:
        if not usable.get(fmt):
            print(f"note: {fmt} is not supported on {environment().get('gpu', device)}: skipped")
    formats = [f for f in formats if usable.get(f)]
    classes = {"int8": Int8Linear, "fp8_e4m3": Fp8Linear}

    shapes = [s for s in SHAPES if not args.quick or s[0] in QUICK]
    if args.m:
        shapes = [(name, args.m, k, n) for name, _, k, n in shapes]
    if args.smoke:
        shapes = [(name, min(m, 64), max(16, k // 20 // 16 * 16), max(16, n // 20 // 16 * 16))
                  for name, m, k, n in shapes]
    rows, layers, inputs = [], {}, {}
    compile_stopped = None
    for name, m, k, n in shapes:
        linear = nn.Linear(k, n, device=device, dtype=torch.float16).requires_grad_(False)
        x = torch.randn(m, k, device=device, dtype=torch.float16)
        layers[name], inputs[name] = linear, x
        reference = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        row = {"shape": name, "M": m, "K": k, "N": n, "density": round(linear_density(m, k, n), 1),
               "flop": 2 * m * n * k, "variants": {}}
        variants = {"fp16": linear}
        for fmt in formats if not args.static_only else ():
            variants[fmt] = classes[fmt].from_float(linear)
        if "fp8_e4m3" in formats:
            variants["fp8_e4m3 static"] = Fp8Linear.from_float(linear).set_input_amax(F.gelu(x).abs().amax())
        raw = {}
        if not args.smoke and not args.static_only and m >= INT_MM_MIN_ROWS:  # the bare _int_mm needs M > 16
            for fmt in formats:
                raw[f"{fmt} raw"] = raw_gemm(fmt, x, variants[fmt])
        for variant, fn in raw.items():
            ms = bench_ms(fn)
            row["variants"][variant] = {"eager_ms": ms}
            print(f"  {name:26s} {variant:13s} {ms:.4f} ms (GEMM only, inputs already 8-bit)", flush=True)
        for variant, module in variants.items():
            entry = {}
            with torch.no_grad():
                y = module(x)
                entry["rel_err"] = rel_error(y, reference)
                entry["nmse"] = normalised_mse(y, reference)
                entry["eager_ms"] = bench_ms(lambda: module(x), args.smoke)
                if not args.no_compile:
                    if time.perf_counter() - started > args.budget_s:
                        compile_stopped = compile_stopped or f"{name} / {variant}"
                    else:
                        compiled = torch.compile(module, mode=args.mode, dynamic=False)
                        t0 = time.perf_counter()
                        yc = compiled(x)
                        sync()
                        entry["compile_s"] = time.perf_counter() - t0
                        entry["compiled_rel_err"] = rel_error(yc, reference)
                        entry["compiled_ms"] = bench_ms(lambda: compiled(x), args.smoke)
                        if variant in ("fp16", "fp8_e4m3 static"):
                            behind_gelu = torch.compile(nn.Sequential(nn.GELU(), module), mode=args.mode,
                                                        dynamic=False)
                            behind_gelu(x)
                            entry["compiled_gelu_ms"] = bench_ms(lambda: behind_gelu(x), args.smoke)
            row["variants"][variant] = entry
            print(f"  {name:26s} {variant:15s} eager {entry['eager_ms']:.4f} ms"
                  + (f"  compiled {entry['compiled_ms']:.4f} ms" if "compiled_ms" in entry else "")
                  + (f"  GELU+layer compiled {entry['compiled_gelu_ms']:.4f} ms" if "compiled_gelu_ms" in entry
                     else "")
                  + f"  rel err {entry['rel_err']:.2e}", flush=True)
        rows.append(row)

    # quantize_ end to end on these layers: calibration + measuring + deciding (the "seconds, not minutes" claim).
    model = nn.ModuleDict({str(i): layers[name] for i, (name, *_rest) in enumerate(shapes)})

    def run_model():
        for i, (name, *_rest) in enumerate(shapes):
            model[str(i)](inputs[name])

    t0 = time.perf_counter()
    plan = plan_quantization(model, QuantConfig(), calibration=run_model)
    sync()
    plan_s = time.perf_counter() - t0
    print()
    print(plan.report.table())

    # Markdown table: speed-up vs fp16 of the same mode (eager vs eager, compiled vs compiled).
    print(f"\n{environment().get('gpu', device)}: ms per call (CUDA graph replay), speed-up vs fp16 in the same mode, relative error "
          f"vs float32")
    quantized_variants = [v for v in rows[0]["variants"] if v != "fp16" and not v.endswith(" raw")] if rows else []
    head = "| shape | M | K | N | density | fp16 eager | fp16 compiled | fp16 GELU+layer compiled |"
    sep = "|---|---|---|---|---|---|---|---|"
    for fmt in quantized_variants:
        head += f" {fmt} eager | {fmt} compiled | {fmt} rel err |"
        sep += "---|---|---|"
    if "fp8_e4m3 static" in quantized_variants:
        head += " fp8 static GELU+layer compiled |"
        sep += "---|"
    print(head)
    print(sep)

    def cell(entry, key, base):
        if key not in entry:
            return "—"
        ratio = f" ({base[key] / entry[key]:.2f}×)" if key in base and entry is not base else ""
        return f"{entry[key]:.4f}{ratio}"

    for row in rows:
        base = row["variants"]["fp16"]
        line = f"| {row['shape']} | {row['M']} | {row['K']} | {row['N']} | {row['density']:.0f} | " \
               f"{cell(base, 'eager_ms', base)} | {cell(base, 'compiled_ms', base)} | " \
               f"{cell(base, 'compiled_gelu_ms', base)} |"
        for fmt in quantized_variants:
            entry = row["variants"][fmt]
            line += f" {cell(entry, 'eager_ms', base)} | {cell(entry, 'compiled_ms', base)} | " \
                    f"{entry['rel_err']:.2e} |"
        if "fp8_e4m3 static" in quantized_variants:
            line += f" {cell(row['variants']['fp8_e4m3 static'], 'compiled_gelu_ms', base)} |"
        print(line)
    speedups = {fmt: [r["variants"]["fp16"]["compiled_ms"] / r["variants"][fmt]["compiled_ms"] for r in rows
                      if "compiled_ms" in r["variants"][fmt] and "compiled_ms" in r["variants"]["fp16"]
                      and r["M"] > 16] for fmt in quantized_variants}
    for fmt, values in speedups.items():
        if values:
            print(f"{fmt}: compiled speed-up vs compiled fp16, median over shapes with M > 16: "
                  f"{statistics.median(values):.2f}×")
    print(f"quantize_ planning (calibration + measuring {len(shapes)} layers): {plan_s:.2f} s; "
          f"quantized: {plan.report.quantized}")
    if compile_stopped:
        print(f"note: compile budget ({args.budget_s:.0f} s) spent; compiled timings stop at {compile_stopped}")
    total = time.perf_counter() - started
    print(f"total wall time {total:.1f} s")

    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"environment": environment(), "settings": vars(args), "rows": rows,
                                   "plan_seconds": plan_s, "report": plan.report.to_dict(),
                                   "compile_stopped_at": compile_stopped, "wall_s": total}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
