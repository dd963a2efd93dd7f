"""Does cuBLASLt's GELU epilogue beat _scaled_mm + Inductor's GELU? Yes, 1.12-2.74x (2026-11-28_h100_fp8_gelu_gemm.json).

A DiT MLP's first fp8 GEMM with tanh-GELU and the second GEMM's e4m3 cast both ways, per shape: time, error against
float32, how many e4m3 values differ, saturation, a CUDA-graph replay. Kept: quantization/cublaslt.py.
Analysis: bench/experiments/fp8-mlp-cublaslt-gelu.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/fp8_gelu_gemm.py --out bench/results/DATE_GPU_fp8_gelu_gemm.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from overdrive.compiler.activations import tanh_gelu_via_sigmoid
from overdrive.quantization import cublaslt, kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, beside probes/
from report import environment  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (rows, width, MLP width)
    "qwen_image_1328_cfg": (2 * 6889, 3072, 12288),
    "wan22_5b_480p_33f_cfg": (2 * 3510, 3072, 14336),
    "flux_double_block_img": (4096, 3072, 12288),
    "flux_double_block_txt": (512, 3072, 12288),
    "sd35_large_1024": (4096, 2432, 9728),
    "odd_rows": (1000, 1024, 4096),
}


def current_path(xq, x_scale, wq, w_scale, bias, out_inverse):
    y = kernels.fp8_gemm(xq, x_scale, wq, w_scale, bias, torch.bfloat16)
    return kernels.quantize_tensor_fp8_static(tanh_gelu_via_sigmoid(y), out_inverse)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def one_shape(rows, width, mlp_width):
    torch.manual_seed(0)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(mlp_width, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    bias = (torch.randn(mlp_width, device="cuda") * 0.1).to(torch.bfloat16)
    wq, w_scale = kernels.quantize_weight_fp8(w)
    x_scale = kernels.static_fp8_scale(x.abs().amax())
    xq = kernels.quantize_tensor_fp8_static(x, 1.0 / x_scale)
    exact = F.gelu(xq.float() @ wq.float().t() * (x_scale * w_scale) + bias.float(), approximate="tanh")
    out_scale = kernels.static_fp8_scale(exact.abs().amax())
    out_inverse = 1.0 / out_scale
    compiled = torch.compile(current_path, dynamic=False)
    ours = compiled(xq, x_scale, wq, w_scale, bias, out_inverse)
    fused = cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, out_inverse)
    fused_no_bias = cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, None, out_inverse)
    exact_no_bias = F.gelu(xq.float() @ wq.float().t() * (x_scale * w_scale), approximate="tanh")
    erf = F.gelu(xq.float() @ wq.float().t() * (x_scale * w_scale) + bias.float())
    row = {
        "ms_scaled_mm_then_inductor_gelu_cast": do_bench(lambda: compiled(xq, x_scale, wq, w_scale, bias, out_inverse),
                                                         return_mode="median"),
        "ms_scaled_mm_alone_bf16_out": do_bench(lambda: kernels.fp8_gemm(xq, x_scale, wq, w_scale, bias,
                                                                          torch.bfloat16), return_mode="median"),
        "ms_cublaslt_gelu_e4m3": do_bench(lambda: cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, out_inverse),
                                          return_mode="median"),
        "rel_err_current_vs_fp32": rel(ours.float() * out_scale, exact),
        "rel_err_cublaslt_vs_fp32": rel(fused.float() * out_scale, exact),
        "rel_err_cublaslt_no_bias_vs_fp32": rel(fused_no_bias.float() * out_scale, exact_no_bias),
        "rel_err_cublaslt_vs_erf_gelu": rel(fused.float() * out_scale, erf),
        "e4m3_values_differing": (ours.view(torch.uint8) != fused.view(torch.uint8)).float().mean().item(),
    }
    # Saturation: an output scale 8x too small must clamp to +-448, not produce NaN (0x7f / 0xff in e4m3fn).
    tight = cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, out_inverse * 8)
    row["saturated_nan"] = int(torch.isnan(tight.float()).sum().item())
    row["saturated_max"] = tight.float().abs().max().item()
    # CUDA-graph capture and replay on fresh inputs.
    static_x = xq.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cublaslt.fp8_gemm_gelu(static_x, x_scale, wq, w_scale, bias, out_inverse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = cublaslt.fp8_gemm_gelu(static_x, x_scale, wq, w_scale, bias, out_inverse)
    static_x.copy_(xq.flip(0))
    graph.replay()
    again = cublaslt.fp8_gemm_gelu(xq.flip(0).contiguous(), x_scale, wq, w_scale, bias, out_inverse)
    row["graph_replay_equal"] = bool(torch.equal(graphed.view(torch.uint8), again.view(torch.uint8)))
    row["speedup"] = row["ms_scaled_mm_then_inductor_gelu_cast"] / row["ms_cublaslt_gelu_e4m3"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {**environment(), "timing": "triton.testing.do_bench median", "shapes": {}}
    for name, (rows, width, mlp_width) in SHAPES.items():
        try:
            row = one_shape(rows, width, mlp_width)
        except Exception as error:  # noqa: BLE001 - record and go on to the next shape
            row = {"error": f"{type(error).__name__}: {error}"}
        result["shapes"][name] = {"rows": rows, "width": width, "mlp_width": mlp_width, **row}
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | current (ms) | _scaled_mm alone | cuBLASLt GELU e4m3 | speedup | err current | err cuBLASLt |")
    print("|---|---|---|---|---|---|---|")
    for name, row in result["shapes"].items():
        if "error" in row:
            print(f"| {name} | {row['error']} |")
            continue
        print(f"| {name} | {row['ms_scaled_mm_then_inductor_gelu_cast']:.4f} | {row['ms_scaled_mm_alone_bf16_out']:.4f}"
              f" | {row['ms_cublaslt_gelu_e4m3']:.4f} | {row['speedup']:.3f}x | {row['rel_err_current_vs_fp32']:.2e}"
              f" | {row['rel_err_cublaslt_vs_fp32']:.2e} |")


if __name__ == "__main__":
    main()
