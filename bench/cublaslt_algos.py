"""cuBLASLt's algorithms for the fp8 GEMMs of the DiTs' blocks: per shape, `torch._scaled_mm` (cuBLASLt's heuristic
choice), the heuristic's first algorithm through Overdrive's binding, and the fastest of the heuristic's first
`cublaslt.CANDIDATES` as the binding times them on its first call (quantization/cublaslt.py). Plain GEMMs write bf16
with the bias; the MLPs' first GEMMs run the GELU epilogue and write e4m3. Times are medians of
`triton.testing.do_bench`; each candidate's configuration (tile, stages, cluster, split-K) is recorded.

    PYTHONPATH=<folder holding overdrive> python bench/cublaslt_algos.py --out bench/results/DATE_GPU_cublaslt_algos.json
"""
import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from overdrive.quantization import cublaslt, kernels
from report import environment

BF16 = torch.bfloat16
SHAPES = {  # name: (rows, out features, in features, GELU epilogue); rows as the model runs them (CFG doubles)
    "qwen_image_1328_cfg_qkvo": (13778, 3072, 3072, False),
    "qwen_image_1328_cfg_mlp_in_gelu": (13778, 12288, 3072, True),
    "qwen_image_1328_cfg_mlp_out": (13778, 3072, 12288, False),
    "wan22_480p_33f_cfg_qkvo": (7020, 3072, 3072, False),
    "wan22_480p_33f_cfg_ffn_in_gelu": (7020, 14336, 3072, True),
    "wan22_480p_33f_cfg_ffn_out": (7020, 3072, 14336, False),
    "flux_1024_double_img_qkv": (4096, 9216, 3072, False),
    "flux_1024_double_img_proj": (4096, 3072, 3072, False),
    "flux_1024_double_img_mlp_in_gelu": (4096, 12288, 3072, True),
    "flux_1024_double_img_mlp_out": (4096, 3072, 12288, False),
    "flux_1024_single_linear1": (4608, 21504, 3072, False),
    "flux_1024_single_linear2": (4608, 3072, 15360, False),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def one_shape(rows, n, k, gelu):
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    wq, w_scale = kernels.quantize_weight_fp8(torch.randn(n, k, device="cuda") * k ** -0.5)
    bias = (torch.randn(n, device="cuda") * 0.1).to(BF16)
    x_scale = kernels.static_fp8_scale(x.abs().amax())
    xq = kernels.quantize_tensor_fp8_static(x, 1.0 / x_scale)
    if gelu:
        out_inverse = 1.0 / kernels.static_fp8_scale(torch.tensor(8.0, device="cuda"))
        ours = lambda: cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, out_inverse)  # noqa: E731
        reference = lambda: kernels.quantize_tensor_fp8_static(  # noqa: E731
            torch.nn.functional.gelu(kernels.scaled_mm_gemm(xq, x_scale, wq, w_scale, bias, BF16).float(),
                                     approximate="tanh"), out_inverse)
    else:
        ours = lambda: cublaslt.fp8_gemm(xq, x_scale, wq, w_scale, bias, BF16)  # noqa: E731
        reference = lambda: kernels.scaled_mm_gemm(xq, x_scale, wq, w_scale, bias, BF16)  # noqa: E731
    tuned_out = ours()  # the first call times the candidates
    plan = cublaslt.plan_of(xq, wq, bias, None if gelu else BF16)
    row = {"plan": plan.describe(), "ms_reference": do_bench(reference, return_mode="median")}
    best = plan.chosen
    plan.chosen = 0
    row["ms_heuristic_first"] = do_bench(ours, return_mode="median")
    first_out = ours()
    plan.chosen = best
    row["ms_tuned"] = do_bench(ours, return_mode="median")
    row["tflops_tuned"] = 2 * rows * n * k / row["ms_tuned"] / 1e9
    row["rel_diff_tuned_vs_heuristic_first"] = rel(tuned_out, first_out)
    if not gelu:
        row["rel_diff_tuned_vs_scaled_mm"] = rel(tuned_out, reference())
    row["speedup_tuned_vs_reference"] = row["ms_reference"] / row["ms_tuned"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {**environment(), "timing": "triton.testing.do_bench median", "candidates": cublaslt.CANDIDATES,
              "reference": "plain: torch._scaled_mm bf16 + bias; GELU: _scaled_mm, then GELU and the e4m3 cast eager",
              "shapes": {}}
    for name, (rows, n, k, gelu) in SHAPES.items():
        try:
            row = one_shape(rows, n, k, gelu)
        except Exception as error:  # noqa: BLE001 - record and go on to the next shape
            row = {"error": f"{type(error).__name__}: {error}"}
        result["shapes"][name] = {"rows": rows, "n": n, "k": k, "gelu": gelu, **row}
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | reference | heuristic #1 | tuned (chosen) | TFLOP/s | candidates' ms |")
    print("|---|---|---|---|---|---|")
    for name, row in result["shapes"].items():
        if "error" in row:
            print(f"| {name} | {row['error']} |")
            continue
        plan = row["plan"]
        print(f"| {name} | {row['ms_reference']:.4f} | {row['ms_heuristic_first']:.4f} | {row['ms_tuned']:.4f} "
              f"(#{plan['chosen']} {plan['configs'][plan['chosen']]}) | {row['tflops_tuned']:.0f} | "
              f"{' '.join(f'{t:.3f}' for t in plan['timings_ms'])} |")


if __name__ == "__main__":
    main()
