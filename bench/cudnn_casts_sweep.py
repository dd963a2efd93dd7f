"""The cuDNN fp8 backend's casts around its graph (attention/cudnn8.py: Q, K, V's amax, then their e4m3 copies) at
other tokens-per-program, warp counts and program orders, at Flux's and Qwen-Image's attention shapes: GPU time per call
(triton.testing.do_bench median), to pick cudnn8.CAST_BLOCK and CAST_WARPS.

    PYTHONPATH=<folder holding overdrive> python bench/cudnn_casts_sweep.py --out bench/results/DATE_GPU_cudnn_casts.json
"""
import argparse
import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from overdrive.attention import cudnn8

SHAPES = {"flux_1024": (1, 24, 4352, 128), "qwen_image_1328": (2, 24, 6953, 128), "wan22_480p": (2, 24, 3510, 128)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "timing": "triton.testing.do_bench median, warmup 50 ms, rep 300 ms", "shapes": {}}
    default = (cudnn8.CAST_BLOCK, cudnn8.CAST_WARPS, cudnn8.CAST_HEADS_FIRST)
    for name, shape in SHAPES.items():
        b, h, n, d = shape
        # ComfyUI's layout: (batch, tokens, heads * dim) viewed as (batch, heads, tokens, dim)
        q, k, v = (torch.randn((b, n, h, d), device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        casts = cudnn8._Casts(q.shape, k.shape, q.device)
        expected = [t.clone() for t in cudnn8.quantize(q, k, v, cudnn8._Casts(q.shape, k.shape, q.device))]
        rows = []
        for block, warps, heads_first in [(b_, w, f) for b_, w in [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8),
                                                                     (256, 8)] for f in (False, True)]:
            cudnn8.CAST_BLOCK, cudnn8.CAST_WARPS, cudnn8.CAST_HEADS_FIRST = block, warps, heads_first
            def run():
                cudnn8.quantize(q, k, v, casts)
                casts.amax.zero_()
            run()
            same = all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                   b_.view(torch.uint8) if b_.dtype != torch.float32 else b_)
                       for a, b_ in zip((casts.q8, casts.k8, casts.v8, casts.scales), expected))
            ms = do_bench(run, warmup=50, rep=300, return_mode="median")
            zero_ms = do_bench(casts.amax.zero_, warmup=50, rep=300, return_mode="median")
            bytes_moved = 3 * q.numel() * 2 * 2 + 3 * q.numel()  # two bf16 reads and one e4m3 write of each
            rows.append({"block": block, "warps": warps, "heads_first": heads_first, "same_bits": same,
                         "ms": ms - zero_ms,
                         "tb_per_s": bytes_moved / (ms - zero_ms) / 1e9})
            print(f"{name} {shape} block {block:4d} warps {warps} heads first {heads_first:d}: {ms - zero_ms:.4f} ms "
                  f"({rows[-1]['tb_per_s']:.2f} TB/s){'' if same else ' DIFFERENT OUTPUT'}")
        cudnn8.CAST_BLOCK, cudnn8.CAST_WARPS, cudnn8.CAST_HEADS_FIRST = default
        result["shapes"][name] = {"shape": shape, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
