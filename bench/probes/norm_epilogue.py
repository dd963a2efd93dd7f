"""Do other Inductor configs speed the blocks' layer-norm kernel? At some shapes; not adopted (2026-11-26_h100_norm_epilogue.json).

Gated residual + layer norm + modulation + e4m3 cast as Inductor compiles it: its defaults, persistent rows up to
4096 channels, multi-kernel, coordinate-descent tuning, and a copy of the bytes (the memory floor).
Analysis: bench/experiments/layer-norm-inductor-configs.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/norm_epilogue.py --out bench/results/DATE_GPU_norm_epilogue.json
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, beside probes/
from report import environment  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (batch, tokens, channels)
    "qwen_image_1328_cfg": (2, 6889, 3072),
    "flux_1024_double_img": (1, 4096, 3072),
    "wan22_5b_480p_cfg": (2, 3510, 3072),
}


class PersistentRows(InductorChoices):
    """Inductor's choices, but a row of up to 4096 elements reduced in one pass (kept in registers)."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction):
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
            return True
        from torch._inductor.runtime.hints import ReductionHint
        return (inductor_config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, 4096))


def epilogue(gemm_out, residual, gate, shift, scale, inverse_scale):
    x = residual + gate * gemm_out
    y = F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift
    return x, (y * inverse_scale).clamp(-448.0, 448.0).to(FP8)


def floor(gemm_out, residual, gate, shift, scale, inverse_scale):
    return gemm_out + residual, gemm_out.to(FP8)


VARIANTS = {
    "default": (epilogue, contextlib.nullcontext, {}),
    "persistent up to 4096": (epilogue, lambda: V.set_choices_handler(PersistentRows()), {}),
    "multi_kernel": (epilogue, contextlib.nullcontext, {"triton.multi_kernel": 1}),
    "coordinate_descent": (epilogue, contextlib.nullcontext, {"coordinate_descent_tuning": True}),
    "copy (floor)": (floor, contextlib.nullcontext, {}),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    inductor_config.fx_graph_cache = False  # its key does not hold the choices handler: each variant compiles anew
    result = {**environment(), "dtype": "bfloat16 in, bfloat16 residual and float8_e4m3fn out",
              "timing": "triton.testing.do_bench median", "shapes": {}}
    for name, (batch, tokens, channels) in SHAPES.items():
        torch.manual_seed(0)
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        inputs = (torch.randn(batch, tokens, channels, **bf16), torch.randn(batch, tokens, channels, **bf16),
                  torch.randn(batch, 1, channels, **bf16), torch.randn(batch, 1, channels, **bf16),
                  torch.randn(batch, 1, channels, **bf16), torch.tensor(0.1, device="cuda"))
        nbytes = batch * tokens * channels * 7  # read output and residual, write residual (bf16) and e4m3
        rows, outputs = {}, {}
        for label, (fn, choices, options) in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, dynamic=False, options=options or None)
            with choices():
                outputs[label] = compiled(*inputs)
            ms = do_bench(lambda: compiled(*inputs), return_mode="median")
            rows[label] = {"ms": ms, "GB_per_s": nbytes / ms / 1e6}
        ref = outputs["default"]
        for label in ("persistent up to 4096", "multi_kernel", "coordinate_descent"):
            rows[label]["same_output"] = all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                                                         b.view(torch.uint8) if b.dtype == FP8 else b)
                                             for a, b in zip(outputs[label], ref))
        result["shapes"][name] = {"shape": (batch, tokens, channels), "bytes": nbytes, **rows}
        print(name, " | ".join(f"{k}: {v['ms'] * 1e3:.1f} us {v['GB_per_s']:.0f} GB/s"
                               + ("" if v.get("same_output", True) else " (differs)") for k, v in rows.items()),
              flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
