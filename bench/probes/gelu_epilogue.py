"""Is the fused tanh-GELU + e4m3 cast faster through a sigmoid? Yes, 18-21 % (2026-11-26_h100_gelu_epilogue.json).

The kernel between a DiT's fp8 MLP GEMMs as Inductor compiles it: GELU as ComfyUI writes it or as x * sigmoid(2z),
the cast dividing by the scale or multiplying by its inverse, and no activation (the memory floor).
Analysis: bench/experiments/gelu-through-sigmoid.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/gelu_epilogue.py --out bench/results/DATE_GPU_gelu_epilogue.json
"""
import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from overdrive.compiler.activations import tanh_gelu_via_sigmoid

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, beside probes/
from report import environment  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (tokens, first GEMM's output width, MLP width, width concatenated before it)
    "flux_single_block": (4608, 21504, 12288, 3072),
    "flux_double_block_img": (4096, 12288, 12288, 0),
    "wan22_5b_480p_ffn": (3510, 14336, 14336, 0),
    "qwen_image_1328_ffn_cfg": (2 * 6889, 12288, 12288, 0),
}
ACTIVATIONS = {
    "tanh (as ComfyUI)": lambda x: F.gelu(x, approximate="tanh"),
    "sigmoid form": tanh_gelu_via_sigmoid,
    "none (floor)": lambda x: x,
}


def epilogue(act, gemm_out, attn, scale, mlp_width, reciprocal):
    mlp = gemm_out[:, gemm_out.shape[1] - mlp_width:]
    x = act(mlp) if attn is None else torch.cat((attn, act(mlp)), 1)
    x = x * scale if reciprocal else x / scale  # reciprocal: scale holds 1 / the scale
    return x.clamp(-448.0, 448.0).to(FP8)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {**environment(), "dtype": "bfloat16 in, float8_e4m3fn out", "timing": "triton.testing.do_bench median",
              "shapes": {}}
    for name, (tokens, width, mlp_width, cat_width) in SHAPES.items():
        torch.manual_seed(0)
        gemm_out = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(tokens, cat_width, device="cuda", dtype=torch.bfloat16) if cat_width else None
        scale = torch.tensor(4.0 / 448, device="cuda")
        nbytes = tokens * (mlp_width * 2 + cat_width * 2 + (mlp_width + cat_width))
        rows, outputs = {}, {}
        for (label, act), reciprocal in itertools.product(ACTIVATIONS.items(), (False, True)):
            torch._dynamo.reset()
            fn = torch.compile(functools.partial(epilogue, act, mlp_width=mlp_width, reciprocal=reciprocal),
                               dynamic=False)
            s = 1 / scale if reciprocal else scale
            label = label + (", x * (1 / scale)" if reciprocal else ", x / scale")
            outputs[label] = fn(gemm_out, attn, s).float()
            ms = do_bench(lambda: fn(gemm_out, attn, s), return_mode="median")
            rows[label] = {"ms": ms, "GB_per_s": nbytes / ms / 1e6}
        ref, fast = outputs["tanh (as ComfyUI), x / scale"], outputs["sigmoid form, x * (1 / scale)"]
        rows["sigmoid_reciprocal_vs_tanh_divide"] = {"rel_err": ((fast - ref).norm() / ref.norm()).item(),
                                   "e4m3_values_differing": (fast != ref).float().mean().item()}
        x = gemm_out[:, width - mlp_width:].float()
        rows["sigmoid_reciprocal_vs_tanh_divide"]["fp32_max_abs"] = (tanh_gelu_via_sigmoid(x)
                                                   - F.gelu(x, approximate="tanh")).abs().max().item()
        result["shapes"][name] = {"tokens": tokens, "width": width, "mlp_width": mlp_width, "cat_width": cat_width,
                                  "bytes": nbytes, **rows}
        print(name, " | ".join(f"{k}: {v['ms'] * 1e3:.1f} us {v['GB_per_s']:.0f} GB/s" for k, v in rows.items()
                               if "ms" in v), "|", rows["sigmoid_reciprocal_vs_tanh_divide"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
