"""cuBLASLt's algorithms for the fp8 MLPs' first GEMM with its GELU epilogue (quantization/cublaslt.py): per shape,
every candidate the heuristic offers (its first `cublaslt.CANDIDATES`) timed with `triton.testing.do_bench` (median,
L2 flushed before each run), the binding's own pick (timed at its first call) and its time, and each candidate's
configuration (tile, stages, cluster, split-K). Plain fp8 GEMMs were measured the same way at 864400c
(`2026-11-28_h100_cublaslt_algos.json`): within noise of `torch._scaled_mm`, so they stay on it.

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
SHAPES = {  # name: (rows, MLP width, width); rows as the model runs them (CFG doubles)
    "qwen_image_1328_cfg": (13778, 12288, 3072),
    "wan22_480p_33f_cfg": (7020, 14336, 3072),
    "flux_1024_double_img": (4096, 12288, 3072),
    "sd35_large_1024": (4096, 9728, 2432),
}


def one_shape(rows, n, k):
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    wq, w_scale = kernels.quantize_weight_fp8(torch.randn(n, k, device="cuda") * k ** -0.5)
    bias = (torch.randn(n, device="cuda") * 0.1).to(BF16)
    x_scale = kernels.static_fp8_scale(x.abs().amax())
    xq = kernels.quantize_tensor_fp8_static(x, 1.0 / x_scale)
    out_inverse = 1.0 / kernels.static_fp8_scale(torch.tensor(8.0, device="cuda"))

    def run():
        return cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, out_inverse)

    picked_out = run()  # the first call times the candidates
    plan = cublaslt.plan_of(xq, wq, bias)
    picked = plan.chosen
    row = {"plan": plan.describe(), "ms_do_bench": []}
    for index in range(len(plan.candidates)):
        plan.chosen = index
        row["ms_do_bench"].append(do_bench(run, return_mode="median"))
        if index == 0:
            first_out = run()
    plan.chosen = picked
    row["ms_do_bench_again_first_and_picked"] = [do_bench(run, return_mode="median")]
    plan.chosen = 0
    row["ms_do_bench_again_first_and_picked"].insert(0, do_bench(run, return_mode="median"))
    plan.chosen = picked
    row["picked"], row["fastest_by_do_bench"] = picked, min(range(len(row["ms_do_bench"])),
                                                            key=row["ms_do_bench"].__getitem__)
    row["picked_vs_first"] = row["ms_do_bench"][0] / row["ms_do_bench"][picked]
    row["e4m3_values_differing_picked_vs_first"] = (picked_out.view(torch.uint8) != first_out.view(torch.uint8)
                                                    ).float().mean().item()
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {**environment(), "timing": "triton.testing.do_bench median", "candidates": cublaslt.CANDIDATES,
              "shapes": {}}
    for name, (rows, n, k) in SHAPES.items():
        try:
            row = one_shape(rows, n, k)
        except Exception as error:  # noqa: BLE001 - record and go on to the next shape
            row = {"error": f"{type(error).__name__}: {error}"}
        result["shapes"][name] = {"rows": rows, "n": n, "k": k, **row}
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | heuristic's first (ms) | picked | picked (ms) | fastest by do_bench | again: first, picked |")
    print("|---|---|---|---|---|---|")
    for name, row in result["shapes"].items():
        if "error" in row:
            print(f"| {name} | {row['error']} |")
            continue
        ms = row["ms_do_bench"]
        print(f"| {name} | {ms[0]:.4f} | #{row['picked']} {row['plan']['configs'][row['picked']]} | "
              f"{ms[row['picked']]:.4f} ({row['picked_vs_first']:.3f}x) | #{row['fastest_by_do_bench']} "
              f"{min(ms):.4f} | {' / '.join(f'{t:.4f}' for t in row['ms_do_bench_again_first_and_picked'])} |")


if __name__ == "__main__":
    main()
