"""Which kernel serves int8 weight-only layers? Overdrive's Triton one: 1.5-3.9x Inductor's (2026-11-26_h100_quantize_gemv.json).

The DiTs' modulation and Qwen-Image's text stream, more rows to find where a GEMM wins (`..._rows.json`): the
kernel's configurations, dequantizing to bf16 then cuBLAS, Inductor's fused reduction, bf16 cuBLAS; in GB/s.
Analysis: bench/experiments/fp8-8bit-attention-weight-only-kernel.md, bench/experiments/weight-only-rows.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/quantize_gemv.py --out bench/results/DATE_GPU_quantize_gemv.json
"""
import argparse
import itertools
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from overdrive.quantization import kernels, triton_kernels

SHAPES = {  # name: (rows, out features, in features)
    "flux_double_mod": (1, 18432, 3072),
    "flux_single_mod": (1, 9216, 3072),
    "qwen_image_mod_cfg": (2, 18432, 3072),
    "wan22_time_proj": (2, 30720, 5120),
    "qwen_image_txt_qkv_cfg": (128, 3072, 3072),
    "qwen_image_txt_mlp_in_cfg": (128, 12288, 3072),
    "qwen_image_txt_mlp_out_cfg": (128, 3072, 12288),
    "rows_32": (32, 3072, 3072),
    "rows_64": (64, 3072, 3072),
    "rows_256": (256, 3072, 3072),
    "rows_512": (512, 3072, 3072),
}
SMEM = 200 * 1024


def configs(rows):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) worth trying for this many rows, within shared memory."""
    block_ms = [bm for bm in (16, 32, 64, 128) if bm == 16 or bm // 2 < rows]
    return [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product(block_ms, (16, 32, 64, 128), (64, 128, 256),
                                                                           (4, 8), (3, 4))
            if (bm * bk * 2 + bn * bk) * s <= SMEM]


def inductor_reduction(x, wq, ws, bias):
    products = x.float().unsqueeze(0) * wq.float().unsqueeze(1)
    return ((products.sum(-1).t() * ws) + bias.float()).to(x.dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "timing": "triton.testing.do_bench median, x bf16",
              "default_configs": triton_kernels.WEIGHT_ONLY_CONFIGS, "shapes": {}}
    compiled = torch.compile(inductor_reduction, dynamic=False)
    for name, (m, n, k) in SHAPES.items():
        torch.manual_seed(0)
        w, bias = torch.randn(n, k, device="cuda") * 0.02, torch.randn(n, device="cuda")
        wq, ws = kernels.quantize_weight_int8(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = kernels.reference_weight_only_linear(x, wq, ws, bias, torch.float32)
        w16, b16 = w.bfloat16(), bias.bfloat16()
        gb = lambda ms, nbytes: nbytes / ms / 1e6  # noqa: E731
        rows = {"bf16_cublas_ms": do_bench(lambda: F.linear(x, w16, b16), return_mode="median"),
                "dequantized_cublas_ms": do_bench(lambda: kernels._dequantized_linear(x, wq, ws, bias, torch.bfloat16),
                                                  return_mode="median"),
                "sweep": []}
        if m <= kernels.WEIGHT_ONLY_REDUCTION_ROWS:
            rows["inductor_reduction_ms"] = do_bench(lambda: compiled(x, wq, ws, bias), return_mode="median")
        for config in configs(m):
            try:
                y = triton_kernels.weight_only_matmul(x, wq, ws, bias, torch.bfloat16, config)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = do_bench(lambda: triton_kernels.weight_only_matmul(x, wq, ws, bias, torch.bfloat16, config),
                              warmup=5, rep=20, return_mode="median")
                rows["sweep"].append({"config": config, "ms": ms, "rel_err": err})
            except Exception as error:  # noqa: BLE001
                rows["sweep"].append({"config": config, "error": str(error)[:200]})
        rows["sweep"].sort(key=lambda r: r.get("ms", 1e9))
        default = triton_kernels.weight_only_config(m)
        rows["default_config"] = default
        rows["default_ms"] = next((r["ms"] for r in rows["sweep"] if tuple(r["config"]) == default), None)
        best = rows["sweep"][0]
        line = (f"{name} ({m}, {n}, {k}): bf16 cuBLAS {rows['bf16_cublas_ms'] * 1e3:.1f} us, dequantized + cuBLAS "
                f"{rows['dequantized_cublas_ms'] * 1e3:.1f} us")
        if "inductor_reduction_ms" in rows:
            line += f", Inductor int8 {rows['inductor_reduction_ms'] * 1e3:.1f} us"
        if rows["default_ms"]:
            line += f", Triton default {rows['default_ms'] * 1e3:.1f} us ({gb(rows['default_ms'], n * k):.0f} GB/s)"
        print(line + f", best {best['config']} {best['ms'] * 1e3:.1f} us ({gb(best['ms'], n * k):.0f} GB/s) "
              f"err {best['rel_err']:.1e}; next {[(r['config'], round(r['ms'] * 1e3, 1)) for r in rows['sweep'][1:4]]}",
              flush=True)
        result["shapes"][name] = {"shape": (m, n, k), **rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
