"""Which outputs does cuDNN's fp8 attention write on Hopper? e4m3, either layout; not bf16 (2026-11-26_h100_cudnn_fp8_output.json).

e4m3 or bf16, heads-major or tokens-major: whether the graph builds, its time, its error against fp32 attention.
Analysis: bench/experiments/fp8-8bit-attention-weight-only-kernel.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/cudnn_fp8_output_probe.py \
        --out bench/results/DATE_GPU_cudnn_fp8_output.json
"""
import argparse
import json

import torch
from triton.testing import do_bench

from overdrive.attention import cudnn8, reference

SHAPES = {"flux_1024": (1, 24, 4608, 128), "sdxl_1024_64x64": (2, 10, 4096, 64)}


def build(shape, sm_scale, out_dtype, tokens_major):
    cudnn = cudnn8.cudnn
    handle = cudnn.create_handle()
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    b, h, s, d = shape
    contiguous = dict(dim=list(shape), stride=[h * s * d, s * d, d, 1], data_type=e4m3)
    q, k, v = (graph.tensor(name=n, **contiguous) for n in "qkv")
    scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    scales = [graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
    out, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, descale_q=scales[0], descale_k=scales[1],
                                            descale_v=scales[2], descale_s=scales[3], scale_s=scales[4],
                                            scale_o=scales[5], is_inference=True, attn_scale=sm_scale,
                                            use_causal_mask=False, name="probe")
    stride = [s * h * d, d, h * d, 1] if tokens_major else [h * s * d, s * d, d, 1]
    out.set_output(True).set_dim(list(shape)).set_stride(stride).set_data_type(
        {"fp8": e4m3, "bf16": cudnn.data_type.BFLOAT16}[out_dtype])
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return handle, graph, (q, k, v, out, amax_s, amax_o, scales)


def probe(shape, out_dtype, tokens_major, scale_o_is_one):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    ref = reference.exact_attention(*qkv)  # (b, h, s, d)
    handle, graph, (q, k, v, out, amax_s, amax_o, scales) = build(shape, d ** -0.5, out_dtype, tokens_major)
    q8, k8, v8, sc = (t.clone() for t in cudnn8.quantize(*qkv))
    o = torch.empty((b, s, h, d) if tokens_major else shape, device="cuda",
                    dtype=torch.bfloat16 if out_dtype == "bf16" else torch.float8_e4m3fn)
    consts = torch.tensor([1 / 448.0, 448.0, 1.0], device="cuda")
    so = consts[2:3] if scale_o_is_one else sc[3:4]
    amaxes = torch.empty(2, device="cuda")
    pack = {q: q8, k: k8, v: v8, out: o, amax_s: amaxes[0:1], amax_o: amaxes[1:2], scales[0]: sc[0:1],
            scales[1]: sc[1:2], scales[2]: sc[2:3], scales[3]: consts[0:1], scales[4]: consts[1:2], scales[5]: so}
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
    cudnn8.cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def run():
        graph.execute(pack, workspace, handle=handle)
    run()
    torch.cuda.synchronize()
    got = o.float()
    if tokens_major:
        got = got.transpose(1, 2)
    alpha = float((got * ref).sum() / (got * got).sum())
    err = reference.relative_error(got * alpha, ref)
    return {"ms": do_bench(run, warmup=50, rep=300, return_mode="median"), "rel_err_after_rescale": err,
            "best_rescale": alpha, "dv": float(sc[2])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "cudnn_frontend": getattr(cudnn8.cudnn, "__version__", None), "shapes": {}}
    for name, shape in SHAPES.items():
        rows = {}
        for out_dtype in ("fp8", "bf16"):
            for tokens_major in (False, True):
                for one in (False, True):
                    label = f"{out_dtype}{'_tokens_major' if tokens_major else ''}{'_scale_o_1' if one else ''}"
                    try:
                        rows[label] = probe(shape, out_dtype, tokens_major, one)
                    except Exception as error:  # noqa: BLE001 - the support check's refusal is the finding
                        rows[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                    print(name, label, rows[label], flush=True)
        result["shapes"][name] = rows
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
