"""LoRAs on fp8 layers: bake or run beside? Beside: equal fidelity, no re-quantizing (2026-12-06_h100_lora_bake_probe.json).

On Flux.1's block linear shapes, a rank-16 LoRA of relative size `--scale`, per layer: the part of its output change
that survives each way, the error against the float layer with it, the time to re-quantize every layer (the bake's
floor) and the side path's two GEMMs against the layer's fp8 GEMM.
Analysis: bench/experiments/loras-on-quantized-layers.md.

    python bench/probes/lora_bake_probe.py --out bench/results/x.json        (the timings need CUDA)
"""
import argparse
import json
import time

import torch

# (rows of input per call, in, out, layers in the model): Flux.1-dev's block linears at 1024², 20 steps
FLUX_LINEARS = [(4096, 3072, 9216, 19), (4096, 3072, 3072, 19), (4096, 3072, 12288, 19), (4096, 12288, 3072, 19),
                (512, 3072, 9216, 19), (512, 3072, 3072, 19), (512, 3072, 12288, 19), (512, 12288, 3072, 19),
                (4608, 3072, 21504, 38), (4608, 15360, 3072, 38)]


def fp8(weight):
    from overdrive.quantization.kernels import FP8_DTYPE, FP8_MAX
    scale = weight.abs().amax().float() / FP8_MAX
    return (weight.float() / scale).to(FP8_DTYPE).float() * scale


def fidelity(rows, k, n, rank, scale, device):
    generator = torch.Generator(device="cpu").manual_seed(k * 7 + n)
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(device)
    up = (torch.randn(n, rank, generator=generator) * scale / rank ** 0.5).to(device)
    down = (torch.randn(rank, k, generator=generator) / k ** 0.5).to(device)
    x = torch.randn(min(rows, 1024), k, generator=generator).to(device)
    delta = up @ down
    reference = x @ (weight + delta).T
    lora_effect = x @ delta.T
    baked = x @ fp8(weight + delta).T
    beside = x @ fp8(weight).T + lora_effect
    kept = lambda out: float(((out - x @ fp8(weight).T) * lora_effect).sum() / (lora_effect * lora_effect).sum())  # noqa: E731
    error = lambda out: float((out - reference).norm() / reference.norm())  # noqa: E731
    return {"lora_kept_baked": round(kept(baked), 3), "lora_kept_beside": round(kept(beside), 3),
            "error_baked": round(error(baked), 4), "error_beside": round(error(beside), 4)}


def seconds(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def timings(rows, k, n, rank, count):
    from overdrive.quantization.kernels import quantize_weight_fp8
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    up, down = (torch.randn(n, rank, device="cuda", dtype=torch.bfloat16),
                torch.randn(rank, k, device="cuda", dtype=torch.bfloat16))
    strength = torch.ones(rank, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight_fp8(weight)
    xq, xs = quantize_weight_fp8(x)
    gemm = seconds(lambda: torch._scaled_mm(xq, wq.T, xs, ws, out_dtype=torch.bfloat16, use_fast_accum=True))
    side = seconds(lambda: torch.nn.functional.linear(torch.nn.functional.linear(x, down) * strength, up))
    requantize = seconds(lambda: quantize_weight_fp8(weight + (up @ down)))
    return {"fp8_gemm_ms": round(gemm * 1e3, 4), "side_path_ms": round(side * 1e3, 4),
            "requantize_ms": round(requantize * 1e3, 4), "layers": count}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.1, help="the LoRA's size relative to the weights")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rows = []
    for m, k, n, count in FLUX_LINEARS:
        row = {"rows": m, "in": k, "out": n, **fidelity(m, k, n, args.rank, args.scale, "cuda" if cuda else "cpu")}
        if cuda:
            row.update(timings(m, k, n, 32, count))  # the side path's smallest rank bucket
        rows.append(row)
        print(row, flush=True)
    total = {}
    if cuda:
        for name in ("fp8_gemm_ms", "side_path_ms", "requantize_ms"):
            total[name.replace("_ms", "_s_per_model_call")] = round(sum(r[name] * r["layers"] for r in rows) / 1e3, 4)
        total["side_path_share_of_gemms"] = round(total["side_path_s_per_model_call"] /
                                                  total["fp8_gemm_s_per_model_call"], 3)
    result = {"probe": "lora_bake", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "rank": args.rank, "scale": args.scale, "rows": rows, "total": total}
    print(json.dumps(total), flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
