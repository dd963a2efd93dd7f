"""cuDNN's fp8 attention through NVIDIA's official Python frontend (`nvidia-cudnn-frontend`, using the cuDNN that
torch ships). Its optional dependencies (cutlass-dsl, tvm-ffi) are not needed for this graph: install it with
`pip install --no-deps nvidia-cudnn-frontend`.

On Hopper cuDNN's fp8 graph takes one scale per tensor and writes its output in fp8, so its error per call is ~6 %
(bench/README.md): the chooser uses it only where the user's error bound allows. Scales are computed per call
(amax of Q, K, V); the output's scale follows from V's, since each output row is a convex combination of V's rows.
One cuDNN graph is built per shape and kept.

Around the graph, three Triton launches instead of ~30 torch ops (whose launches made the backend host-bound): the
three tensors' amax in one, their casts and scales in one, the output's dequantization into the op's layout in one.
"""
from __future__ import annotations

import threading

import torch

from ..quantization.kernels import FP8_MAX
from .triton8 import _token_block, triton

try:
    import cudnn
except Exception:  # noqa: BLE001 - not installed, or its native module does not load here
    cudnn = None

_graphs: dict = {}
_lock = threading.Lock()
BLOCK = 64  # tokens per program of the Triton kernels below

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _amax_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, n_q, n_kv, heads, q_strides, k_strides, v_strides,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """amax[0..2] (zeroed before) = the largest magnitude of Q, K, V (program_id(2) picks the tensor)."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        if which == 0:
            x = tl.load(_token_block(q_ptr, q_strides, bh, heads, rows, cols), mask=(rows < n_q)[:, None], other=0.0)
        elif which == 1:
            x = tl.load(_token_block(k_ptr, k_strides, bh, heads, rows, cols), mask=(rows < n_kv)[:, None], other=0.0)
        else:
            x = tl.load(_token_block(v_ptr, v_strides, bh, heads, rows, cols), mask=(rows < n_kv)[:, None], other=0.0)
        tl.atomic_max(amax_ptr + which, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0), sem="relaxed")

    @triton.jit
    def _cast_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, q8_ptr, k8_ptr, v8_ptr, scales_ptr, n_q, n_kv, heads, q_strides,
                     k_strides, v_strides, FP8_MAX: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """Q, K, V over their descales (amax / 448) into contiguous e4m3 copies; scales = [dq, dk, dv, 1 / dv]."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        descale = tl.maximum(tl.load(amax_ptr + which) / FP8_MAX, 1e-20)
        if which == 0:
            _cast_block(q_ptr, q_strides, q8_ptr, n_q, descale, pid, bh, heads, HEAD_DIM, BLOCK)
        elif which == 1:
            _cast_block(k_ptr, k_strides, k8_ptr, n_kv, descale, pid, bh, heads, HEAD_DIM, BLOCK)
        else:
            _cast_block(v_ptr, v_strides, v8_ptr, n_kv, descale, pid, bh, heads, HEAD_DIM, BLOCK)
        if pid == 0 and bh == 0:
            tl.store(scales_ptr + which, descale)
            if which == 2:
                tl.store(scales_ptr + 3, 1.0 / descale)

    @triton.jit
    def _cast_block(src, strides, dst, n, descale, pid, bh, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        valid = (rows < n)[:, None]
        x = tl.load(_token_block(src, strides, bh, heads, rows, cols), mask=valid, other=0.0).to(tl.float32)
        tl.store(dst + (bh * n + rows)[:, None] * HEAD_DIM + cols[None, :], (x / descale).to(dst.dtype.element_ty),
                 mask=valid)

    @triton.jit
    def _output_kernel(o8_ptr, scales_ptr, out_ptr, amax_ptr, n, heads, ZERO_AMAX: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """cuDNN's e4m3 (batch, heads, tokens, dim) output times V's descale, as (batch, tokens, heads, dim); with
        ZERO_AMAX, amax[0..2] is reset for the next call (the casts that read it are done)."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        valid = (rows < n)[:, None]
        x = tl.load(o8_ptr + (bh * n + rows)[:, None] * HEAD_DIM + cols[None, :], mask=valid, other=0.0)
        y = x.to(tl.float32) * tl.load(scales_ptr + 2)
        b, h = bh // heads, bh % heads
        out = out_ptr + ((b * n + rows) * heads + h)[:, None] * HEAD_DIM + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=valid)
        if ZERO_AMAX:
            if pid == 0 and bh == 0:
                three = tl.arange(0, 4)
                tl.store(amax_ptr + three, tl.zeros([4], tl.float32), mask=three < 3)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if cudnn is None:
        return "nvidia-cudnn-frontend is not installed (pip install --no-deps nvidia-cudnn-frontend)"
    if triton is None:
        return "Triton is not installed"
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
        self.shape_q, self.shape_kv = tuple(shape_q), tuple(shape_kv)
        self.constants = torch.tensor([1.0 / FP8_MAX, FP8_MAX], dtype=torch.float32, device=device)
        self.amax_out = torch.empty(2, dtype=torch.float32, device=device)  # cuDNN's amax outputs, not used
        self.operands: dict = {}  # CUDA stream -> _Operands

    def operands_for(self, stream) -> "_Operands":
        operands = self.operands.get(stream.cuda_stream)
        if operands is None:
            operands = self.operands[stream.cuda_stream] = _Operands(self, stream.device)
        return operands

    def run(self, operands: "_Operands", stream) -> None:
        cudnn.set_stream(handle=self.handle, stream=stream.cuda_stream)
        self.graph.execute(operands.pack, self.workspace, handle=self.handle)


class _Casts:
    """Contiguous e4m3 copies of Q, K and V, their maxima (zero between calls) and scales [dq, dk, dv, 1 / dv]."""

    def __init__(self, shape_q, shape_kv, device):
        e4m3 = torch.float8_e4m3fn
        self.q8 = torch.empty(shape_q, dtype=e4m3, device=device)
        self.k8, self.v8 = (torch.empty(shape_kv, dtype=e4m3, device=device) for _ in range(2))
        self.amax = torch.zeros(3, dtype=torch.float32, device=device)
        self.scales = torch.empty(4, dtype=torch.float32, device=device)


class _Operands(_Casts):
    """A graph's fp8 inputs and output, scales and cuDNN variant pack for one CUDA stream, reused by each call there
    (a stream runs its calls in order): a call allocates nothing and builds no pack. Doing both at each call made
    Flux's fp8 run slower with this backend than without it (1.970 against 1.845 s per image on an H100,
    `2026-11-26_h100_flux_1024_cudnn_attention_host_bound.json`). `amax` is zeroed again by the output kernel."""

    def __init__(self, graph: _Graph, device):
        super().__init__(graph.shape_q, graph.shape_kv, device)
        self.out8 = torch.empty(graph.shape_q, dtype=torch.float8_e4m3fn, device=device)
        # P in [0, 1] is stored times 448 (descale_s 1/448, scale_s 448); O's rows are convex combinations of V's
        # rows, so |O| <= amax(V): O's scale is 1 / dv.
        scales, constants = self.scales, graph.constants
        values = (scales[0:1], scales[1:2], scales[2:3], constants[0:1], constants[1:2], scales[3:4])
        self.pack = {graph.q: self.q8, graph.k: self.k8, graph.v: self.v8, graph.out: self.out8,
                     graph.amax[0]: graph.amax_out[0:1], graph.amax[1]: graph.amax_out[1:2],
                     **dict(zip(graph.scales, values))}


def _graph(shape_q, shape_kv, sm_scale, device) -> _Graph:
    key = (tuple(shape_q), tuple(shape_kv), sm_scale, str(device))
    with _lock:
        graph = _graphs.get(key)
        if graph is None:
            graph = _graphs[key] = _Graph(shape_q, shape_kv, sm_scale, device)
    return graph


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, casts: _Casts | None = None):
    """(q8, k8, v8, scales): contiguous e4m3 copies of (batch, heads, tokens, head dim) views (head dim contiguous),
    each over one descale, and scales = [dq, dk, dv, 1 / dv] (float32, on the device). Two launches; written into
    `casts` if given (whose amax is zero), else into new tensors."""
    batch, heads, n_q, dim = q.shape
    n_kv = k.shape[2]
    o = casts or _Casts(q.shape, k.shape, q.device)
    strides = [tuple(t.stride()[:3]) for t in (q, k, v)]
    grid = (triton.cdiv(max(n_q, n_kv), BLOCK), batch * heads, 3)
    _amax_kernel[grid](q, k, v, o.amax, n_q, n_kv, heads, *strides, HEAD_DIM=dim, BLOCK=BLOCK, num_warps=4)
    _cast_kernel[grid](q, k, v, o.amax, o.q8, o.k8, o.v8, o.scales, n_q, n_kv, heads, *strides, FP8_MAX=FP8_MAX,
                       HEAD_DIM=dim, BLOCK=BLOCK, num_warps=4)
    return o.q8, o.k8, o.v8, o.scales


def dequantize_output(out8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      amax: torch.Tensor | None = None) -> torch.Tensor:
    """cuDNN's e4m3 (batch, heads, tokens, head dim) output times V's descale, as (batch, tokens, heads, head dim);
    `amax` (the casts' maxima) is zeroed for the next call."""
    batch, heads, n, dim = out8.shape
    out = torch.empty((batch, n, heads, dim), dtype=dtype, device=out8.device)
    _output_kernel[(triton.cdiv(n, BLOCK), batch * heads)](out8, scales, out, scales if amax is None else amax, n,
                                                           heads, ZERO_AMAX=amax is not None, HEAD_DIM=dim,
                                                           BLOCK=BLOCK, num_warps=4)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ · sm_scale)·v for (batch, heads, tokens, head dim) inputs (views with the head dim contiguous),
    returned as (batch, tokens, heads, head dim), contiguous, in q's dtype."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    graph = _graph(q.shape, k.shape, sm_scale, q.device)
    stream = torch.cuda.current_stream(q.device)
    operands = graph.operands_for(stream)
    quantize(q, k, v, operands)
    graph.run(operands, stream)
    return dequantize_output(operands.out8, operands.scales, q.dtype, operands.amax)
