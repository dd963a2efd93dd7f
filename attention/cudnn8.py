"""cuDNN's fp8 attention through NVIDIA's official Python frontend (`nvidia-cudnn-frontend`, using the cuDNN that
torch ships). Its optional dependencies (cutlass-dsl, tvm-ffi) are not needed for this graph: install it with
`pip install --no-deps nvidia-cudnn-frontend`.

On Hopper cuDNN's fp8 graph takes one scale per tensor and writes its output in fp8, so its error per call is ~6 %
(bench/README.md): the chooser uses it only where the user's error bound allows. Scales are computed per call
(amax of Q, K, V); the output's scale follows from V's, since each output row is a convex combination of V's rows.
One cuDNN graph is built per shape and stride pattern and kept.
"""
from __future__ import annotations

import threading

import torch

from ..quantization.kernels import FP8_MAX

try:
    import cudnn
except Exception:  # noqa: BLE001 - not installed, or its native module does not load here
    cudnn = None

_graphs: dict = {}
_lock = threading.Lock()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if cudnn is None:
        return "nvidia-cudnn-frontend is not installed (pip install --no-deps nvidia-cudnn-frontend)"
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
        return "needs a Hopper or newer NVIDIA GPU"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16 inputs (got {q.dtype})"
    if q.shape[-1] % 16 or q.shape[-1] > 256 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (cuDNN fp8 takes multiples of 16 up to 256)"
    return None


class _Graph:
    """One built cuDNN fp8 SDPA graph for a (shape, sm_scale, device)."""

    def __init__(self, shape_q, shape_kv, sm_scale, device):
        self.handle = cudnn.create_handle()
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=self.handle)

        def contiguous(name, shape):
            b, h, s, d = shape
            return graph.tensor(name=name, dim=list(shape), stride=[h * s * d, s * d, d, 1], data_type=e4m3)

        self.q, self.k, self.v = contiguous("q", shape_q), contiguous("k", shape_kv), contiguous("v", shape_kv)
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
        self.scales = [graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
        out, _, amax_s, amax_o = graph.sdpa_fp8(q=self.q, k=self.k, v=self.v, descale_q=self.scales[0],
                                                descale_k=self.scales[1], descale_v=self.scales[2],
                                                descale_s=self.scales[3], scale_s=self.scales[4],
                                                scale_o=self.scales[5], is_inference=True, attn_scale=sm_scale,
                                                use_causal_mask=False, name="overdrive_fp8_attention")
        b, h, s, d = shape_q
        out.set_output(True).set_dim(list(shape_q)).set_stride([h * s * d, s * d, d, 1]).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        self.out, self.amax = out, (amax_s, amax_o)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)

    def run(self, q8, k8, v8, scales, out8, amax):
        pack = {self.q: q8, self.k: k8, self.v: v8, self.out: out8, self.amax[0]: amax[0], self.amax[1]: amax[1]}
        pack.update(zip(self.scales, scales))
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)


def _graph(shape_q, shape_kv, sm_scale, device) -> _Graph:
    key = (tuple(shape_q), tuple(shape_kv), sm_scale, str(device))
    with _lock:
        graph = _graphs.get(key)
        if graph is None:
            graph = _graphs[key] = _Graph(shape_q, shape_kv, sm_scale, device)
    return graph


def _to_fp8(x: torch.Tensor):
    """(contiguous e4m3 copy, its descale) with one scale for the tensor."""
    descale = (x.abs().amax().float() / FP8_MAX).clamp_min(1e-20)
    return (x / descale).to(torch.float8_e4m3fn).contiguous(), descale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ · sm_scale)·v for (batch, heads, tokens, head dim) inputs, returned as (batch, tokens, heads,
    head dim), contiguous, in q's dtype."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    graph = _graph(q.shape, k.shape, sm_scale, q.device)
    (q8, dq), (k8, dk), (v8, dv) = _to_fp8(q), _to_fp8(k), _to_fp8(v)
    one = torch.ones((), dtype=torch.float32, device=q.device)
    # P in [0, 1] is stored times 448; O's rows are convex combinations of V's, so |O| <= amax(V).
    scales = [t.reshape(1, 1, 1, 1) for t in (dq, dk, dv, one / FP8_MAX, one * FP8_MAX, 1.0 / dv)]
    out8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    amax = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device) for _ in range(2)]
    graph.run(q8, k8, v8, scales, out8, amax)
    return (out8.to(torch.float32) * dv).to(q.dtype).transpose(1, 2).contiguous()
