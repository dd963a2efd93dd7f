"""triton8.py's 8-bit attention (int8 Q·Kᵀ, e4m3 P·V, fp32 softmax, 16-bit output, the same prepared operands)
written in Gluon, Triton's explicit dialect, for Hopper, with FlashAttention-3's schedule: a producer warpgroup
streams K and V by TMA, and two consumer warpgroups, each with its own 64 query rows, take turns on the tensor cores
(ping-pong): while one runs its Q·Kᵀ and P·V, the other runs its softmax. Within each consumer, the softmax of key
block j+1 runs under that block's P·V of block j (intra-warpgroup overlap).

Why: the Triton kernel runs two independent one-warpgroup programs per SM, and its sm_90 SASS shows that no unit is
saturated there (517 instructions a key block; tensor cores ~40 % busy, bench/README.md): each program waits on its
own chain (Q·Kᵀ -> softmax -> P·V), and nothing makes the two programs' chains interleave. Here a turn barrier
does; the two consumers also share each K/V tile, so an SM loads K and V once per 128 query rows instead of twice.

Per consumer, key block j (S = scores, P = probabilities, acc = the output accumulator):
    wait for my turn; issue S(j+1) = Q·K(j+1)ᵀ; acc *= alpha(j); issue acc += P(j)·V(j); pass the turn
    wait for S(j+1); softmax of S(j+1) -> P(j+1), alpha(j+1)       (under P(j)·V(j) and the other's GEMMs)
    wait for P(j)·V(j); release block j's stage to the producer
The last key block is peeled and masked (prepared operands pad the keys to 128).
"""
from __future__ import annotations

import torch

from . import triton8

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only installs, a Triton without Gluon's Hopper ops
    gluon = None

AVAILABLE = gluon is not None and triton8.AVAILABLE
CONSUMER_ROWS = 64  # query rows per consumer warpgroup (one wgmma M); a program takes two consumers' worth
# (BLOCK_N, STAGES, consumer registers) per head dim.
CONFIGS = {64: (128, 3, 240), 128: (128, 3, 240)}

if gluon is not None:
    @gluon.jit
    def _softmax(s, m_i, l_i, q_scale, k_scale, start_n, n_kv, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 MASKED: gl.constexpr):
        """triton8._attend_block's softmax on the scores (int32 from int8 Q·Kᵀ, fp32 from e4m3): P times 448 (e4m3's
        range), the rescale factor of the running sums, the new row sum and max (log2 domain)."""
        c = q_scale * k_scale
        if s.dtype == gl.int32:  # int32 -> fp32 by an integer add (see triton8): the scores are raw - 12582912
            raw = (s + 0x4B400000).to(gl.float32, bitcast=True)
            offset = 12582912.0 * c
        else:
            raw = s
            offset = gl.zeros_like(c)
        if MASKED:
            keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            raw = gl.where(gl.expand_dims(keys < n_kv, 0), raw, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(raw, axis=1) * c - offset)
        p = gl.exp2(raw * gl.expand_dims(c, 1) - gl.expand_dims(offset + m_new - 8.807354922057604, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, l_i, m_new

    @gluon.jit
    def _take_turn(turns, me, turn):
        """Wait until the other consumer has issued its GEMMs (consumer 0's first turn passes at once: a fresh
        mbarrier reads as having completed the phase before its first)."""
        mbarrier.wait(turns.index(me), (turn & 1) ^ (1 - me))
        return turn + 1

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, q_row, kv_row, v_row,
                  n_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Both consumers' query rows, then each key block into a stage once both consumers released it (the empty
        barriers' first round passes at once)."""
        for c in gl.static_range(2):
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + c * BLOCK_M, 0], q_bars.index(c),
                                            q_smem.index(c))
        for block in range(n_blocks):
            stage = block % STAGES
            mbarrier.wait(empty.index(stage), ((block // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + block * BLOCK_N, 0], bar, k_smem.index(stage))
            tma.async_copy_global_to_shared(v_desc, [v_row, block * BLOCK_N], bar, v_smem.index(stage))

    @gluon.jit
    def _step(j, turn, me, s, p, alpha, acc, m_i, l_i, q_scale, q_smem, k_smem, v_smem, ready, empty, turns,
              k_scale_ptr, scale_row, n_kv, s_layout: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr):
        """Key block j's P·V and block j+1's scores and softmax (the module's docstring)."""
        nxt = j + 1
        k_scale = gl.load(k_scale_ptr + scale_row + nxt)  # issued first: its latency hides under the waits
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        turn = _take_turn(turns, me, turn)
        s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        acc = warpgroup_mma(p8, v_smem.index(j % STAGES).permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(turns.index(1 - me), count=1)
        s = warpgroup_mma_wait(1, deps=(s, ))  # S(j+1) is ready; P(j)·V(j) runs on under the softmax
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, q_scale, k_scale, nxt * BLOCK_N, n_kv, s_layout, BLOCK_N, MASKED)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(j % STAGES), count=1)
        return turn, s, p, alpha, acc, m_i, l_i

    @gluon.jit
    def _consumer(me, q_smem, k_smem, v_smem, q_bars, ready, empty, turns, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                  out_ptr, bh, q_row, q_first, scale_row, n_blocks, n_q, n_kv, heads, stride_ob, stride_oh,
                  stride_on, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
        """One consumer warpgroup's query rows (q_row + me * BLOCK_M in the prepared Q): the whole key loop, then
        the output's store."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
        my_q = q_smem.index(me)
        q_scale = gl.load(q_scale_ptr + q_row + me * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        last = n_blocks - 1

        mbarrier.wait(q_bars.index(me), 0)
        mbarrier.wait(ready.index(0), 0)
        turn = _take_turn(turns, me, 0)
        s_dtype: gl.constexpr = gl.int32 if k_smem.dtype == gl.int8 else gl.float32
        s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], s_dtype, s_layout),
                          use_acc=False, is_async=True)
        mbarrier.arrive(turns.index(1 - me), count=1)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, q_scale, gl.load(k_scale_ptr + scale_row), 0, n_kv, s_layout,
                                      BLOCK_N, True)
        # the last key block is the only partial one: its step alone masks
        for j in range(0, last - 1):
            turn, s, p, alpha, acc, m_i, l_i = _step(j, turn, me, s, p, alpha, acc, m_i, l_i, q_scale, my_q, k_smem,
                                                     v_smem, ready, empty, turns, k_scale_ptr, scale_row, n_kv,
                                                     s_layout, p_layout, o_rows, BLOCK_N, STAGES, False)
        if last > 0:
            turn, s, p, alpha, acc, m_i, l_i = _step(last - 1, turn, me, s, p, alpha, acc, m_i, l_i, q_scale, my_q,
                                                     k_smem, v_smem, ready, empty, turns, k_scale_ptr, scale_row,
                                                     n_kv, s_layout, p_layout, o_rows, BLOCK_N, STAGES, True)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        turn = _take_turn(turns, me, turn)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        acc = warpgroup_mma(p8, v_smem.index(last % STAGES).permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(turns.index(1 - me), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(last % STAGES), count=1)

        cols = gl.arange(0, HEAD_DIM, layout=o_cols)
        v_scale = gl.load(v_scale_ptr + bh * HEAD_DIM + cols)
        out = acc * gl.expand_dims(v_scale, 0) / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
        rows = q_first + me * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        base = out_ptr + (bh // heads).to(gl.int64) * stride_ob + (bh % heads).to(gl.int64) * stride_oh
        ptrs = base + gl.expand_dims(rows.to(gl.int64) * stride_on, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < n_q, 1))

    @gluon.jit
    def _attention_kernel(q_desc, k_desc, v_desc, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                          n_q, n_kv, heads, nq_pad, nkv_pad, stride_ob, stride_oh, stride_on,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        gl.static_assert(STAGES >= 2, "block j+1 loads while block j is in use")
        pid = gl.program_id(0)
        bh = gl.program_id(1)
        q_first = pid * 2 * BLOCK_M
        q_row = bh * nq_pad + q_first
        kv_row = bh * nkv_pad
        v_row = bh * HEAD_DIM
        scale_row = bh * (nkv_pad // BLOCK_N)
        n_blocks = gl.cdiv(n_kv, BLOCK_N)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(turns.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage

        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, q_row, kv_row, v_row,
                         n_blocks, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (0, q_smem, k_smem, v_smem, q_bars, ready, empty, turns, q_scale_ptr, k_scale_ptr,
                         v_scale_ptr, out_ptr, bh, q_row, q_first, scale_row, n_blocks, n_q, n_kv, heads, stride_ob,
                         stride_oh, stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bars, ready, empty, turns, q_scale_ptr, k_scale_ptr,
                         v_scale_ptr, out_ptr, bh, q_row, q_first, scale_row, n_blocks, n_q, n_kv, heads, stride_ob,
                         stride_oh, stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
        for i in gl.static_range(2):
            mbarrier.invalidate(q_bars.index(i))
            mbarrier.invalidate(turns.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernel applies to these (batch, heads, tokens, head dim) tensors, else why not."""
    if gluon is None:
        return "this Triton has no Gluon Hopper ops"
    return triton8.supports(q, k, v)


def _descriptor(tensor: torch.Tensor, block: list, dtype) -> "TensorDescriptor":
    return TensorDescriptor.from_tensor(tensor, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def attend(prepared: dict, batch: int, heads: int, dim: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """triton8.attend's contract (operands from triton8.prepare with pv="fp8"), this kernel. config: (BLOCK_N,
    STAGES, consumer registers); its BLOCK_N must be the one the operands were prepared with."""
    block_n, stages, regs = config or CONFIGS[dim]
    if block_n != prepared["block_n"]:
        raise ValueError(f"operands prepared for key blocks of {prepared['block_n']}, config has {block_n}")
    if prepared["v"].dtype != torch.float8_e4m3fn:
        raise ValueError("the Gluon kernel takes e4m3 V (triton8.prepare with pv='fp8')")
    qk_type = gl.int8 if prepared["q"].dtype == torch.int8 else gl.float8e4nv
    q_desc = _descriptor(prepared["q"], [CONSUMER_ROWS, dim], qk_type)
    k_desc = _descriptor(prepared["k"], [block_n, dim], qk_type)
    v_desc = _descriptor(prepared["v"], [dim, block_n], gl.float8e4nv)
    grid = (-(-prepared["n_q"] // (2 * CONSUMER_ROWS)), batch * heads)
    _attention_kernel[grid](q_desc, k_desc, v_desc, prepared["q_scale"], prepared["k_scale"], prepared["v_scale"],
                            out, prepared["n_q"], prepared["n_kv"], heads, prepared["nq_pad"], prepared["nkv_pad"],
                            out.stride(0), out.stride(2), out.stride(1), HEAD_DIM=dim, BLOCK_M=CONSUMER_ROWS,
                            BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=regs, num_warps=4)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
              config=None, qk: str = "int8") -> torch.Tensor:
    """triton8.attention's contract, through this kernel (P·V in e4m3; Q·Kᵀ in int8 or, qk="fp8", e4m3)."""
    batch, heads, n_q, dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    config = config or CONFIGS[dim]
    prepared = triton8.prepare(q, k, v, dim ** -0.5 if sm_scale is None else sm_scale, "fp8", config[0], qk)
    out = torch.empty((batch, n_q, heads, dim), dtype=q.dtype, device=q.device)
    return attend(prepared, batch, heads, dim, out, config)
