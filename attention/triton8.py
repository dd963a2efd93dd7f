"""8-bit attention in Triton for Hopper: Q·Kᵀ in int8, P·V in fp8 (e4m3) or fp16, softmax in fp32, 16-bit output.

The scheme (SageAttention's ideas, in a FlashAttention-2-style loop):
- K is smoothed: its mean over the tokens is subtracted per head and channel. softmax(q·(k - k̄)) = softmax(q·k),
  because q·k̄ is the same for every key of a query row, and K's large shared offset (common in trained models) no
  longer eats the int8 range.
- Q is quantized to int8 with one scale per token, K with one scale per key block of the kernel: the score of a
  query/key pair is (q8·k8) · sq · sk, so the scales apply exactly, after the integer product, as one multiply per
  row of a block.
- P (after the running row max is subtracted, so 0 <= p <= 1) is cast to e4m3 times 448 (e4m3's largest value),
  which keeps small probabilities out of fp8's subnormals; the factor is folded into the exponent and cancels
  against the row sum.
- V is cast to e4m3 with one scale per head and channel (over all tokens): the sum over keys runs along each
  channel, so its scale applies exactly to the output column.
- The row sum of P, the running max and the accumulator stay in fp32; the output is written once, in 16 bits.

Two P·V precisions, one kernel: `pv="fp8"` runs both products at the 8-bit rate; `pv="fp16"` keeps P·V in fp16
(V still divided by its channel scale, so it cannot overflow). On random N(0, 1) inputs the int8 Q·Kᵀ alone costs
~0.9 % relative error per call, e4m3 P another ~2.7 % (3 mantissa bits: the floor of any fp8 P·V) and V ~0.5 %,
while inputs with a shared V offset, as trained models have, land far lower (reference.py reproduces these; the
chooser measures the error on the model's own inputs).

Hopper's fp8 matrix instructions need both operands of P·V K-major, so V is stored transposed (head dim rows,
tokens contiguous) by the preparation kernel; K's natural layout (head dim contiguous) is already K-major for Q·Kᵀ.
Sequence lengths need not be multiples of the blocks: prepared tensors are padded to 128 tokens, and the last key
block masks its padding.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs; a Triton too old for host-side tensor descriptors
    triton = None

AVAILABLE = triton is not None
PAD = 128  # prepared tensors are padded to a multiple of this many tokens (the largest block below)
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, from bench/attention_kernels.py's sweep on an H200.
CONFIGS = {(64, "fp8"): (64, 128, 4, 3), (128, "fp8"): (64, 128, 4, 3),
           (64, "fp16"): (64, 128, 4, 3), (128, "fp16"): (64, 128, 4, 2)}

if triton is not None:
    @triton.jit
    def _stats_kernel(k_ptr, v_ptr, stats_ptr, n, heads, k_strides, v_strides, HEAD_DIM: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Per (batch*head, channel): K's sum over the tokens and V's largest magnitude, accumulated atomically
        into stats (2, batch*head, channel), zeroed before."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        valid = (rows < n)[:, None]
        k = tl.load(_token_block(k_ptr, k_strides, bh, heads, rows, cols), mask=valid, other=0.0).to(tl.float32)
        v = tl.load(_token_block(v_ptr, v_strides, bh, heads, rows, cols), mask=valid, other=0.0).to(tl.float32)
        bh_heads = bh * HEAD_DIM + cols
        tl.atomic_add(stats_ptr + bh_heads, tl.sum(k, axis=0), sem="relaxed")
        tl.atomic_max(stats_ptr + tl.num_programs(1) * HEAD_DIM + bh_heads, tl.max(tl.abs(v), axis=0), sem="relaxed")

    @triton.jit
    def _token_block(ptr, strides, bh, heads, rows, cols):
        stride_b, stride_h, stride_n = strides
        return (ptr + (bh // heads).to(tl.int64) * stride_b + (bh % heads).to(tl.int64) * stride_h
                + rows[:, None] * stride_n + cols[None, :])

    @triton.jit
    def _quantize_kernel(q_ptr, k_ptr, v_ptr, stats_ptr, q8_ptr, q_scale_ptr, k8_ptr, k_scale_ptr, v8_ptr,
                         v_scale_ptr, n_q, n_kv, heads, q_strides, k_strides, v_strides, nq_pad, nkv_pad, q_mult,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """One launch for the three operands (program_id(2): 0 = Q, 1 = K, 2 = V), BLOCK tokens per program:
        Q to int8 with a scale per token (times q_mult: the softmax scale and log2 e), K smoothed and to int8 with
        one scale per BLOCK tokens (the attention kernel's key block), V over its channel scales, transposed."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        which = tl.program_id(2)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        n_bh = tl.num_programs(1)
        if which == 0:
            if pid * BLOCK < nq_pad:
                x = tl.load(_token_block(q_ptr, q_strides, bh, heads, rows, cols), mask=(rows < n_q)[:, None],
                            other=0.0).to(tl.float32)
                scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 127.0, 1e-20)
                out_rows = bh * nq_pad + rows
                tl.store(q8_ptr + out_rows[:, None] * HEAD_DIM + cols[None, :], _round_int8(x / scale[:, None]))
                tl.store(q_scale_ptr + out_rows, scale * q_mult)
        elif which == 1:
            if pid * BLOCK < nkv_pad:
                valid = (rows < n_kv)[:, None]
                mean = tl.load(stats_ptr + bh * HEAD_DIM + cols) / n_kv
                x = tl.load(_token_block(k_ptr, k_strides, bh, heads, rows, cols), mask=valid, other=0.0)
                x = tl.where(valid, x.to(tl.float32) - mean[None, :], 0.0)
                scale = tl.maximum(tl.max(tl.abs(x)) / 127.0, 1e-20)
                out_rows = bh * nkv_pad + rows
                tl.store(k8_ptr + out_rows[:, None] * HEAD_DIM + cols[None, :], _round_int8(x / scale))
                tl.store(k_scale_ptr + bh * (nkv_pad // BLOCK) + pid, scale)
        else:
            if pid * BLOCK < nkv_pad:
                scale = tl.maximum(tl.load(stats_ptr + n_bh * HEAD_DIM + bh * HEAD_DIM + cols) / 448.0, 1e-20)
                x = tl.load(_token_block(v_ptr, v_strides, bh, heads, rows, cols), mask=(rows < n_kv)[:, None],
                            other=0.0).to(tl.float32)
                # Transposed in registers (through shared memory), so that the store runs along the tokens.
                y = tl.trans((x / scale[None, :]).to(v8_ptr.dtype.element_ty))
                tl.store(v8_ptr + (bh * HEAD_DIM + cols)[:, None].to(tl.int64) * nkv_pad + rows[None, :], y)
                if pid == 0:
                    tl.store(v_scale_ptr + bh * HEAD_DIM + cols, scale)

    @triton.jit
    def _round_int8(y):
        """Round half away from zero; |y| <= 127 by construction."""
        return tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)

    @triton.jit
    def _attend_block(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_ptr, kv_row, v_row, scale_row, start_n,
                      n_kv, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        k = k_desc.load([kv_row + start_n, 0])
        # int32 -> float32 without the slow conversion instruction: for |x| < 2**22, the bits of 0x4B400000 + x
        # read as a float are 12582912 + x exactly (|q8·k8| <= 127² · 128 < 2**21), an integer add instead.
        raw = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
        c = q_scale * tl.load(k_scale_ptr + scale_row + start_n // BLOCK_N)  # per row: log2-domain score per unit
        if MASKED:
            raw = tl.where((start_n + tl.arange(0, BLOCK_N) < n_kv)[None, :], raw, 0.0)
        m_new = tl.maximum(m_i, (tl.max(raw, axis=1) - 12582912.0) * c)
        # p * 448 (fp8's range, out of its subnormals) = exp2(raw * c - (12582912 * c + m_new) + log2(448)); the
        # fused multiply-add keeps the large terms' cancellation exact. The row sum carries the same 448.
        p = tl.math.exp2(raw * c[:, None] - (12582912.0 * c + m_new - 8.807354922057604)[:, None])
        if MASKED:
            p = tl.where((start_n + tl.arange(0, BLOCK_N) < n_kv)[None, :], p, 0.0)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = v_desc.load([v_row, start_n])
        acc = tl.dot(p.to(v.dtype), v.T, acc * alpha[:, None])
        return acc, l_i, m_new

    @triton.jit
    def _attention_kernel(q_desc, k_desc, v_desc, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                          n_q, n_kv, heads, nq_pad, nkv_pad, stride_ob, stride_oh, stride_on,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        q_row = bh * nq_pad + pid * BLOCK_M
        kv_row = bh * nkv_pad
        v_row = bh * HEAD_DIM
        scale_row = bh * (nkv_pad // BLOCK_N)
        q = q_desc.load([q_row, 0])
        q_scale = tl.load(q_scale_ptr + q_row + tl.arange(0, BLOCK_M))
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        full = (n_kv // BLOCK_N) * BLOCK_N
        for start_n in tl.range(0, full, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_ptr, kv_row, v_row,
                                          scale_row, start_n, n_kv, BLOCK_N, False)
        if full < n_kv:
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_ptr, kv_row, v_row,
                                          scale_row, full, n_kv, BLOCK_N, True)
        cols = tl.arange(0, HEAD_DIM)
        out = acc * (tl.load(v_scale_ptr + bh * HEAD_DIM + cols)[None, :] / l_i[:, None])
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        base = out_ptr + (bh // heads).to(tl.int64) * stride_ob + (bh % heads).to(tl.int64) * stride_oh
        tl.store(base + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows < n_q)[:, None])


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernel applies to these (batch, heads, tokens, head dim) tensors, else why not."""
    if not AVAILABLE:
        return "Triton is not installed"
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
        return "needs a Hopper or newer NVIDIA GPU"
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"needs fp16/bf16 inputs of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (supported: {', '.join(map(str, HEAD_DIMS))})"
    return None


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


PV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp16": torch.float16}


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, pv: str = "fp8",
            block_n: int | None = None) -> dict:
    """The kernel's operands: int8 Q with a scale per token (carrying the softmax scale and log2 e), int8 smoothed K
    with a scale per key block, V transposed over its per-channel scales in e4m3 or fp16 (`pv`). Inputs are
    (batch, heads, tokens, head dim) views with the head dim contiguous. Three launches: a zeroing, the statistics
    (K's mean, V's channel amax), the quantization of all three."""
    batch, heads, n_q, dim = q.shape
    n_kv = k.shape[2]
    block_n = block_n or CONFIGS[dim, pv][1]
    nq_pad, nkv_pad = _padded(n_q), _padded(n_kv)
    bh = batch * heads
    device = q.device
    out = {"n_q": n_q, "n_kv": n_kv, "nq_pad": nq_pad, "nkv_pad": nkv_pad, "block_n": block_n,
           "q": torch.empty((bh * nq_pad, dim), dtype=torch.int8, device=device),
           "q_scale": torch.empty((bh * nq_pad,), dtype=torch.float32, device=device),
           "k": torch.empty((bh * nkv_pad, dim), dtype=torch.int8, device=device),
           "k_scale": torch.empty((bh * (nkv_pad // block_n),), dtype=torch.float32, device=device),
           "v": torch.empty((bh * dim, nkv_pad), dtype=PV_DTYPES[pv], device=device),
           "v_scale": torch.empty((bh * dim,), dtype=torch.float32, device=device)}
    stats = torch.zeros((2, bh, dim), dtype=torch.float32, device=device)
    strides = [tuple(t.stride()[:3]) for t in (q, k, v)]
    _stats_kernel[(triton.cdiv(n_kv, 128), bh)](k, v, stats, n_kv, heads, strides[1], strides[2], HEAD_DIM=dim,
                                               BLOCK=128, num_warps=8)
    blocks = max(nq_pad, nkv_pad) // block_n
    _quantize_kernel[(blocks, bh, 3)](q, k, v, stats, out["q"], out["q_scale"], out["k"], out["k_scale"], out["v"],
                                      out["v_scale"], n_q, n_kv, heads, *strides, nq_pad, nkv_pad, sm_scale * LOG2E,
                                      HEAD_DIM=dim, BLOCK=block_n, num_warps=8 if block_n * dim >= 16384 else 4)
    return out


def attend(prepared: dict, batch: int, heads: int, dim: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """The attention kernel over prepared operands, written into `out` (batch, tokens, heads, head dim) or any view
    with the head dim contiguous. config: (BLOCK_M, BLOCK_N, warps, stages[, warp specialization]); its BLOCK_N
    must be the one the operands were prepared with."""
    pv = "fp8" if prepared["v"].dtype == torch.float8_e4m3fn else "fp16"
    block_m, block_n, warps, stages, *rest = config or CONFIGS[dim, pv]
    if block_n != prepared["block_n"]:
        raise ValueError(f"operands prepared for key blocks of {prepared['block_n']}, config has {block_n}")
    q_desc = TensorDescriptor.from_tensor(prepared["q"], [block_m, dim])
    k_desc = TensorDescriptor.from_tensor(prepared["k"], [block_n, dim])
    v_desc = TensorDescriptor.from_tensor(prepared["v"], [dim, block_n])
    grid = (triton.cdiv(prepared["n_q"], block_m), batch * heads)
    _attention_kernel[grid](q_desc, k_desc, v_desc, prepared["q_scale"], prepared["k_scale"], prepared["v_scale"],
                            out, prepared["n_q"], prepared["n_kv"], heads, prepared["nq_pad"], prepared["nkv_pad"],
                            out.stride(0), out.stride(2), out.stride(1), HEAD_DIM=dim, BLOCK_M=block_m,
                            BLOCK_N=block_n, NUM_STAGES=stages, WARP_SPECIALIZE=bool(rest and rest[0]),
                            num_warps=warps, num_stages=stages)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None, pv: str = "fp8",
              config=None) -> torch.Tensor:
    """softmax(q·kᵀ · sm_scale)·v for (batch, heads, tokens, head dim) inputs (views with the head dim contiguous),
    returned as (batch, tokens, heads, head dim), contiguous, in q's dtype."""
    batch, heads, n_q, dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    config = config or CONFIGS[dim, pv]
    prepared = prepare(q, k, v, dim ** -0.5 if sm_scale is None else sm_scale, pv, config[1])
    out = torch.empty((batch, n_q, heads, dim), dtype=q.dtype, device=q.device)
    return attend(prepared, batch, heads, dim, out, config)
