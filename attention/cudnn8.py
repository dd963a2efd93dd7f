"""cuDNN's fp8 attention through NVIDIA's official Python frontend (`nvidia-cudnn-frontend`, using the cuDNN that
torch ships). Its optional dependencies (cutlass-dsl, tvm-ffi) are not needed for this graph: install it with
`pip install --no-deps nvidia-cudnn-frontend`.

On Hopper cuDNN's fp8 graph takes one scale per tensor and writes its output in fp8, so its error per call is a few
percent (bench/EXPERIMENTS.md): the chooser uses it only where the user's error bound allows. One cuDNN graph is
built per shape and kept.

Scales: each tensor's scale is carried from the call before at that shape (on that stream) while it fits: the cast
reads Q, K and V once, casting with the carried scale and taking their maxima as it goes; where a maximum shows the
carried scale would clip (more than `HEADROOM` x the maximum it came from) or waste range (more than `WINDOW` x the
tensor's own maximum), a second pass casts that tensor again at its own maximum, which is then carried. Taking the
maxima before casting reads Q, K and V twice at every call, which measured slower at Flux's shape
(bench/EXPERIMENTS.md). e4m3 keeps its 3-bit mantissa from 2^-6 to 448, so a scale `WINDOW` times too large loses
precision only on the tensor's smallest values. The output's scale follows from V's, since each output row is a
convex combination of V's rows. All of it runs on the GPU (no host sync), so CUDA graphs replay it.

Around the graph, three Triton launches instead of ~30 torch ops (whose launches made the backend host-bound): the
casts with their maxima, the second pass (which returns at once where it has nothing to do), and the output's
dequantization into the op's layout, which also carries the scales to the next call.
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

HEADROOM = 2.0  # a carried scale maps this many times the maximum it came from to 448 (values may grow that much)
WINDOW = 8.0  # ... and is kept while the tensor's own maximum is at least 1/WINDOW of what it maps to 448

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _recast_needed(amax, carried, HEADROOM: tl.constexpr, WINDOW: tl.constexpr):
        """Whether a tensor whose maximum is `amax` needs its own scale instead of the one carried from `carried`
        (0 before the first call: always)."""
        return (amax > carried * HEADROOM) | (amax * WINDOW < carried * HEADROOM)

    @triton.jit
    def _cast_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, carried_ptr, q8_ptr, k8_ptr, v8_ptr, n_q, n_kv, heads, q_strides,
                     k_strides, v_strides, FP8_MAX: tl.constexpr, HEADROOM: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK: tl.constexpr):
        """Q, K, V at their carried scales into contiguous e4m3 copies; amax[0..2] (zero before) = their maxima."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        descale = tl.maximum(tl.load(carried_ptr + which) * HEADROOM / FP8_MAX, 1e-20)
        block_max = _cast_tensor_block(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, n_q, n_kv, heads, q_strides,
                                       k_strides, v_strides, which, descale, pid, bh, FP8_MAX, HEAD_DIM, BLOCK)
        tl.atomic_max(amax_ptr + which, block_max, sem="relaxed")

    @triton.jit
    def _recast_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, carried_ptr, q8_ptr, k8_ptr, v8_ptr, scales_ptr, n_q, n_kv,
                       heads, q_strides, k_strides, v_strides, FP8_MAX: tl.constexpr, HEADROOM: tl.constexpr,
                       WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """scales = [dq, dk, dv, 1 / dv] of this call; a tensor whose carried scale does not fit is cast again at its
        own (every program of the others returns after two loads)."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        amax, carried = tl.load(amax_ptr + which), tl.load(carried_ptr + which)
        recast = _recast_needed(amax, carried, HEADROOM, WINDOW)
        descale = tl.maximum(tl.where(recast, amax, carried * HEADROOM) / FP8_MAX, 1e-20)
        if pid == 0 and bh == 0:
            tl.store(scales_ptr + which, descale)
            if which == 2:
                tl.store(scales_ptr + 3, 1.0 / descale)
        if recast:
            _cast_tensor_block(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, n_q, n_kv, heads, q_strides, k_strides,
                               v_strides, which, descale, pid, bh, FP8_MAX, HEAD_DIM, BLOCK)

    @triton.jit
    def _cast_tensor_block(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, n_q, n_kv, heads, q_strides, k_strides,
                           v_strides, which, descale, pid, bh, FP8_MAX: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK: tl.constexpr):
        """`_cast_block` of Q, K or V (`which` 0, 1, 2); its maximum."""
        if which == 0:
            block_max = _cast_block(q_ptr, q_strides, q8_ptr, n_q, descale, pid, bh, heads, FP8_MAX, HEAD_DIM, BLOCK)
        elif which == 1:
            block_max = _cast_block(k_ptr, k_strides, k8_ptr, n_kv, descale, pid, bh, heads, FP8_MAX, HEAD_DIM, BLOCK)
        else:
            block_max = _cast_block(v_ptr, v_strides, v8_ptr, n_kv, descale, pid, bh, heads, FP8_MAX, HEAD_DIM, BLOCK)
        return block_max

    @triton.jit
    def _cast_block(src, strides, dst, n, descale, pid, bh, heads, FP8_MAX: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK: tl.constexpr):
        """One block of tokens over `descale` into e4m3 (clamped: a clipping scale is recast after); its maximum."""
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        valid = (rows < n)[:, None]
        x = tl.load(_token_block(src, strides, bh, heads, rows, cols), mask=valid, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(x / descale, -FP8_MAX), FP8_MAX)
        tl.store(dst + (bh * n + rows)[:, None] * HEAD_DIM + cols[None, :], scaled.to(dst.dtype.element_ty),
                 mask=valid)
        return tl.max(tl.max(tl.abs(x), axis=1), axis=0)

    @triton.jit
    def _carry(amax_ptr, carried_ptr, HEADROOM: tl.constexpr, WINDOW: tl.constexpr):
        """The scales a tensor was recast at are carried to the next call; amax[0..2] is reset (the casts that read
        them are done)."""
        three = tl.arange(0, 4)
        used = three < 3
        amax = tl.load(amax_ptr + three, mask=used, other=0.0)
        carried = tl.load(carried_ptr + three, mask=used, other=0.0)
        carried = tl.where(_recast_needed(amax, carried, HEADROOM, WINDOW), amax, carried)
        tl.store(carried_ptr + three, carried, mask=used)
        tl.store(amax_ptr + three, tl.zeros([4], tl.float32), mask=used)

    @triton.jit
    def _output_kernel(o8_ptr, scales_ptr, out_ptr, amax_ptr, carried_ptr, n, heads, CARRY: tl.constexpr,
                       HEADROOM: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """cuDNN's e4m3 (batch, heads, tokens, dim) output times V's descale, as (batch, tokens, heads, dim); with
        CARRY, the scales are carried (`_carry`)."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        valid = (rows < n)[:, None]
        x = tl.load(o8_ptr + (bh * n + rows)[:, None] * HEAD_DIM + cols[None, :], mask=valid, other=0.0)
        y = x.to(tl.float32) * tl.load(scales_ptr + 2)
        b, h = bh // heads, bh % heads
        out = out_ptr + ((b * n + rows) * heads + h)[:, None] * HEAD_DIM + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=valid)
        if CARRY:
            if pid == 0 and bh == 0:
                _carry(amax_ptr, carried_ptr, HEADROOM, WINDOW)

    @triton.jit
    def _finish_kernel(scales_ptr, descale_ptr, amax_ptr, carried_ptr, HEADROOM: tl.constexpr,
                       WINDOW: tl.constexpr):
        """After a graph that wrote its e4m3 output for the caller: that output's descale (V's) into the caller's
        tensor, and the scales carried (`_carry`)."""
        tl.store(descale_ptr, tl.load(scales_ptr + 2))
        _carry(amax_ptr, carried_ptr, HEADROOM, WINDOW)


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
    """One built cuDNN fp8 SDPA graph for a (shape, sm_scale, device), its e4m3 output (batch, heads, tokens, head dim)
    in that order in memory, or, `tokens_major_out`, in (batch, tokens, heads, head dim) order: the layout the
    out-projection reads."""

    def __init__(self, shape_q, shape_kv, sm_scale, device, tokens_major_out=False, heuristics=("A", "FALLBACK")):
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
        out_stride = [s * h * d, d, h * d, 1] if tokens_major_out else [h * s * d, s * d, d, 1]
        out.set_output(True).set_dim(list(shape_q)).set_stride(out_stride).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        self.out, self.amax = out, (amax_s, amax_o)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([getattr(cudnn.heur_mode, mode) for mode in heuristics])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        self.shape_q, self.shape_kv, self.tokens_major_out = tuple(shape_q), tuple(shape_kv), tokens_major_out
        self.constants = torch.tensor([1.0 / FP8_MAX, FP8_MAX], dtype=torch.float32, device=device)
        self.amax_out = torch.empty(2, dtype=torch.float32, device=device)  # cuDNN's amax outputs, not used
        self.operands: dict = {}  # CUDA stream -> _Operands

    def operands_for(self, stream) -> "_Operands":
        operands = self.operands.get(stream.cuda_stream)
        if operands is None:
            operands = self.operands[stream.cuda_stream] = _Operands(self, stream.device)
        return operands

    def run(self, pack: dict, stream) -> None:
        cudnn.set_stream(handle=self.handle, stream=stream.cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)


class _Casts:
    """Contiguous e4m3 copies of Q, K and V, their maxima (zero between calls), the maxima their carried scales come
    from (zero: none yet) and this call's scales [dq, dk, dv, 1 / dv]."""

    def __init__(self, shape_q, shape_kv, device):
        e4m3 = torch.float8_e4m3fn
        self.q8 = torch.empty(shape_q, dtype=e4m3, device=device)
        self.k8, self.v8 = (torch.empty(shape_kv, dtype=e4m3, device=device) for _ in range(2))
        self.amax = torch.zeros(3, dtype=torch.float32, device=device)
        self.carried = torch.zeros(3, dtype=torch.float32, device=device)
        self.scales = torch.empty(4, dtype=torch.float32, device=device)


class _Operands(_Casts):
    """A graph's fp8 inputs and output, scales and cuDNN variant pack for one CUDA stream, reused by each call there
    (a stream runs its calls in order): a call allocates nothing and builds no pack. Doing both at each call made
    Flux's fp8 run slower with this backend than without it (`..._h100_flux_1024_cudnn_attention_host_bound.json`).
    The output kernel zeroes `amax` again and carries the scales."""

    def __init__(self, graph: _Graph, device):
        super().__init__(graph.shape_q, graph.shape_kv, device)
        # A tokens-major graph writes a new tensor for its caller at each call (`attention_e4m3`), set in the pack then.
        self.out8 = None if graph.tokens_major_out else torch.empty(graph.shape_q, dtype=torch.float8_e4m3fn,
                                                                    device=device)
        # P in [0, 1] is stored times 448 (descale_s 1/448, scale_s 448); O's rows are convex combinations of V's
        # rows, so |O| <= amax(V): O's scale is 1 / dv.
        scales, constants = self.scales, graph.constants
        values = (scales[0:1], scales[1:2], scales[2:3], constants[0:1], constants[1:2], scales[3:4])
        self.pack = {graph.q: self.q8, graph.k: self.k8, graph.v: self.v8, graph.out: self.out8,
                     graph.amax[0]: graph.amax_out[0:1], graph.amax[1]: graph.amax_out[1:2],
                     **dict(zip(graph.scales, values))}


def _graph(shape_q, shape_kv, sm_scale, device, tokens_major_out=False) -> _Graph:
    key = (tuple(shape_q), tuple(shape_kv), sm_scale, str(device), tokens_major_out)
    with _lock:
        graph = _graphs.get(key)
        if graph is None:
            graph = _graphs[key] = _Graph(shape_q, shape_kv, sm_scale, device, tokens_major_out)
    return graph


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, casts: _Casts | None = None):
    """(q8, k8, v8, scales): contiguous e4m3 copies of (batch, heads, tokens, head dim) views (head dim contiguous),
    each over one descale, and scales = [dq, dk, dv, 1 / dv] (float32, on the device). Two launches; written into
    `casts` if given (whose amax is zero; scales carried from its last call where they fit, module docstring), else
    into new tensors, at each tensor's own maximum."""
    batch, heads, n_q, dim = q.shape
    n_kv = k.shape[2]
    o = casts or _Casts(q.shape, k.shape, q.device)
    shared = (q, k, v, o.amax, o.carried, o.q8, o.k8, o.v8)
    sizes = (n_q, n_kv, heads, *[tuple(t.stride()[:3]) for t in (q, k, v)])
    grid = (triton.cdiv(max(n_q, n_kv), BLOCK), batch * heads, 3)
    _cast_kernel[grid](*shared, *sizes, FP8_MAX=FP8_MAX, HEADROOM=HEADROOM, HEAD_DIM=dim, BLOCK=BLOCK, num_warps=4)
    _recast_kernel[grid](*shared, o.scales, *sizes, FP8_MAX=FP8_MAX, HEADROOM=HEADROOM, WINDOW=WINDOW, HEAD_DIM=dim,
                         BLOCK=BLOCK, num_warps=4)
    return o.q8, o.k8, o.v8, o.scales


def dequantize_output(out8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      casts: _Casts | None = None) -> torch.Tensor:
    """cuDNN's e4m3 (batch, heads, tokens, head dim) output times V's descale, as (batch, tokens, heads, head dim);
    with `casts` (the call's), its scales are carried to the next call and its maxima zeroed."""
    batch, heads, n, dim = out8.shape
    out = torch.empty((batch, n, heads, dim), dtype=dtype, device=out8.device)
    amax, carried = (scales, scales) if casts is None else (casts.amax, casts.carried)
    _output_kernel[(triton.cdiv(n, BLOCK), batch * heads)](out8, scales, out, amax, carried, n, heads,
                                                           CARRY=casts is not None, HEADROOM=HEADROOM, WINDOW=WINDOW,
                                                           HEAD_DIM=dim, BLOCK=BLOCK, num_warps=4)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ · sm_scale)·v for (batch, heads, tokens, head dim) inputs (views with the head dim contiguous),
    returned as (batch, tokens, heads, head dim), contiguous, in q's dtype."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    graph = _graph(q.shape, k.shape, sm_scale, q.device)
    stream = torch.cuda.current_stream(q.device)
    operands = graph.operands_for(stream)
    quantize(q, k, v, operands)
    graph.run(operands.pack, stream)
    return dequantize_output(operands.out8, operands.scales, q.dtype, operands)


def attention_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention` that hands over cuDNN's e4m3 output instead of dequantizing it: (out8 (batch, tokens, heads, head
    dim) e4m3, descale (1,) float32), output = out8 * descale. Both are new tensors (the caller may keep them); the
    compiled graph dequantizes out8 inside the kernel that reads it next (attention/e4m3_output.py)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    graph = _graph(q.shape, k.shape, sm_scale, q.device, tokens_major_out=True)
    stream = torch.cuda.current_stream(q.device)
    operands = graph.operands_for(stream)
    batch, heads, tokens, dim = q.shape
    out8 = torch.empty((batch, tokens, heads, dim), dtype=torch.float8_e4m3fn, device=q.device)
    descale = torch.empty(1, dtype=torch.float32, device=q.device)
    quantize(q, k, v, operands)
    # cuDNN addresses the (batch, heads, tokens, dim) tensor it was built for through tokens-major strides.
    graph.run({**operands.pack, graph.out: out8}, stream)
    _finish_kernel[(1,)](operands.scales, descale, operands.amax, operands.carried, HEADROOM=HEADROOM, WINDOW=WINDOW,
                         num_warps=1)
    return out8, descale
