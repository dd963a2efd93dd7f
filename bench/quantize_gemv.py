"""The weight-only int8 layers of the DiTs' modulation (a few rows times a large weight: bound by reading it) on the
GPU: Overdrive's Triton kernel (each configuration of a small sweep), Inductor's fused reduction of the plain torch
formula (what compiled code ran before the kernel), and the bf16 layer through cuBLAS, in GB/s of weight read.

    PYTHONPATH=<folder holding overdrive> python bench/quantize_gemv.py --out bench/results/DATE_GPU_quantize_gemv.json
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
}
CONFIGS = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4, 5))
           if not (bn == 128 and bk == 256 and s == 5)]


def inductor_reduction(x, wq, ws, bias):
    products = x.float().unsqueeze(0) * wq.float().unsqueeze(1)
    return ((products.sum(-1).t() * ws) + bias.float()).to(x.dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "timing": "triton.testing.do_bench median, x bf16",
              "default_config": triton_kernels.GEMV_CONFIG, "shapes": {}}
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
                "inductor_reduction_ms": do_bench(lambda: compiled(x, wq, ws, bias), return_mode="median"),
                "sweep": []}
        for config in CONFIGS:
            try:
                y = triton_kernels.weight_only_gemv(x, wq, ws, bias, torch.bfloat16, config)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = do_bench(lambda: triton_kernels.weight_only_gemv(x, wq, ws, bias, torch.bfloat16, config),
                              return_mode="median")
                rows["sweep"].append({"config": config, "ms": ms, "rel_err": err})
            except Exception as error:  # noqa: BLE001
                rows["sweep"].append({"config": config, "error": str(error)[:200]})
        rows["sweep"].sort(key=lambda r: r.get("ms", 1e9))
        rows["default_ms"] = next(r["ms"] for r in rows["sweep"] if r.get("config") == triton_kernels.GEMV_CONFIG)
        best = rows["sweep"][0]
        print(f"{name} ({m}, {n}, {k}): bf16 cuBLAS {rows['bf16_cublas_ms'] * 1e3:.1f} us "
              f"({gb(rows['bf16_cublas_ms'], 2 * n * k):.0f} GB/s), Inductor int8 {rows['inductor_reduction_ms'] * 1e3:.1f}"
              f" us ({gb(rows['inductor_reduction_ms'], n * k):.0f} GB/s), Triton default {rows['default_ms'] * 1e3:.1f} us "
              f"({gb(rows['default_ms'], n * k):.0f} GB/s), best {best['config']} {best['ms'] * 1e3:.1f} us "
              f"({gb(best['ms'], n * k):.0f} GB/s) err {best['rel_err']:.1e}")
        result["shapes"][name] = {"shape": (m, n, k), **rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
