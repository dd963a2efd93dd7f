"""Is another cuDNN plan faster for the fp8 attention graph? No: cudnn8.py's first is (2026-11-26_h100_cudnn_fp8_plans.json).

Every plan heuristics A, B and FALLBACK offer, per shape: whether it builds, its time, its error against fp32.
Analysis: bench/experiments/fp8-attention-carried-scales.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/cudnn_fp8_plans_probe.py \
        --out bench/results/DATE_GPU_cudnn_fp8_plans.json
"""
import argparse
import json

import torch

from overdrive.attention import cudnn8, reference
from overdrive.attention.choice import _median_ms

SHAPES = {"flux_1024": (1, 24, 4352, 128), "qwen_image_1328_cfg": (2, 24, 6953, 128),
          "wan22_720p_121f_cfg": (2, 24, 27280, 128), "sdxl_1024_64x64": (2, 10, 4096, 64)}


def probe(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    built = cudnn8._Graph(q.shape, k.shape, shape[-1] ** -0.5, q.device, heuristics=("A", "B", "FALLBACK"))
    stream = torch.cuda.current_stream()
    operands = built.operands_for(stream)
    exact = reference.exact_attention(q, k, v)
    graph = built.graph
    rows = []
    for index in range(graph.get_execution_plan_count()):
        row = {"index": index, "name": graph.get_plan_name_at_index(index)}
        try:
            graph.build_plan_at_index(index)
            workspace = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8,
                                    device="cuda")

            def run():
                cudnn8.quantize(q, k, v, operands)
                graph.execute_plan_at_index(operands.pack, workspace, index, handle=built.handle)
                return cudnn8.dequantize_output(operands.out8, operands.scales, q.dtype, operands)

            out = run()
            row.update(ms=_median_ms(run), rel_err=reference.relative_error(out.transpose(1, 2), exact),
                       workspace_mb=workspace.numel() / 2**20)
        except Exception as error:  # noqa: BLE001 - a plan that does not build here is reported, not fatal
            row["failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "frontend": getattr(cudnn8.cudnn, "__version__", None),
              "shapes": {}}
    for name in args.shapes.split(","):
        print(name, SHAPES[name], flush=True)
        report["shapes"][name] = {"shape": SHAPES[name], "plans": probe(SHAPES[name])}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
