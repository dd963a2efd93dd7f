"""triton8.py's 8-bit attention (int8 Q·Kᵀ, e4m3 P·V, fp32 softmax, 16-bit output, the same prepared operands)
written in Gluon, Triton's lower-level dialect, for Hopper: the schedule is explicit, so the softmax of one key block
runs while the tensor cores work on the next block's scores and the previous block's P·V (FlashAttention-3's
intra-warpgroup pipelining). Triton's own scheduler waits for each Q·Kᵀ right after issuing it, so there the
softmax and the tensor cores only overlap across the programs that share an SM (bench/README.md, "8-bit attention").

Per key block j, in one warpgroup (or two, each with its own query rows):
    issue S(j+1) = Q·K(j+1)ᵀ          (async)
    softmax of S(j) -> P(j), alpha     (overlaps S(j+1) and P(j-1)·V(j-1))
    wait for P(j-1)·V(j-1); acc *= alpha; refill the stage block j-1 used with block j+STAGES-1
    issue acc += P(j)·V(j)             (async)
    wait for S(j+1)
Keys stream through STAGES shared-memory stages by TMA (blocks j, j+1 and the refill are in flight at once, hence
STAGES >= 3). The last key block is peeled and masked (prepared operands pad the keys to 128).
"""
from __future__ import annotations

import torch

from . import triton8

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only installs, a Triton without Gluon's Hopper ops
    gluon = None

AVAILABLE = gluon is not None and triton8.AVAILABLE
# (BLOCK_M, BLOCK_N, num_warps, STAGES) per head dim.
CONFIGS = {64: (64, 128, 4, 3), 128: (64, 128, 4, 3)}

if gluon is not None:
    @gluon.jit
    def _softmax(s, m_i, l_i, q_scale, k_scale, start_n, n_kv, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 MASKED: gl.constexpr):
        """triton8._attend_block's softmax on int32 scores: P times 448 (e4m3's range), the rescale factor of the
        running sums, the new row sum and max (log2 domain)."""
        raw = (s + 0x4B400000).to(gl.float32, bitcast=True)  # int32 -> fp32 by an integer add (see triton8)
        c = q_scale * k_scale
        if MASKED:
            keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            raw = gl.where(gl.expand_dims(keys < n_kv, 0), raw, 0.0)
        m_new = gl.maximum(m_i, (gl.max(raw, axis=1) - 12582912.0) * c)
        p = gl.exp2(raw * gl.expand_dims(c, 1) - gl.expand_dims(12582912.0 * c + m_new - 8.807354922057604, 1))
        if MASKED:
            p = gl.where(gl.expand_dims(keys < n_kv, 0), p, 0.0)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, l_i, m_new

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, block, n_blocks, kv_row, v_row, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
        """TMA of key block `block` (K rows and V's transposed columns) into its stage; nothing past the last."""
        stage = block % STAGES
        pred = block < n_blocks
        bar = bars.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [kv_row + block * BLOCK_N, 0], bar, k_smem.index(stage), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [v_row, block * BLOCK_N], bar, v_smem.index(stage), pred=pred)

    @gluon.jit
    def _attention_kernel(q_desc, k_desc, v_desc, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                          n_q, n_kv, heads, nq_pad, nkv_pad, stride_ob, stride_oh, stride_on,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(STAGES >= 2, "block j+1 loads while block j is in use")
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

        pid = gl.program_id(0)
        bh = gl.program_id(1)
        q_row = bh * nq_pad + pid * BLOCK_M
        kv_row = bh * nkv_pad
        v_row = bh * HEAD_DIM
        scale_row = bh * (nkv_pad // BLOCK_N)
        n_blocks = gl.cdiv(n_kv, BLOCK_N)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, i, n_blocks, kv_row, v_row, BLOCK_N, STAGES)

        q_scale = gl.load(q_scale_ptr + q_row + gl.arange(0, BLOCK_M, layout=s_rows))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        last = n_blocks - 1

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, q_scale, gl.load(k_scale_ptr + scale_row), 0, n_kv, s_layout,
                                      BLOCK_N, True)
        for j in range(0, last):
            nxt = j + 1
            mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1)
            # the scores' registers are free (P(j) is out of them): S(j+1) is written over them
            s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s, use_acc=False, is_async=True)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            acc = warpgroup_mma(p8, v_smem.index(j % STAGES).permute((1, 0)), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))  # S(j+1) is ready; P(j)·V(j) runs on under the softmax
            k_scale = gl.load(k_scale_ptr + scale_row + nxt)
            if nxt == last:
                p, alpha, l_i, m_i = _softmax(s, m_i, l_i, q_scale, k_scale, nxt * BLOCK_N, n_kv, s_layout, BLOCK_N,
                                              True)
            else:
                p, alpha, l_i, m_i = _softmax(s, m_i, l_i, q_scale, k_scale, nxt * BLOCK_N, n_kv, s_layout, BLOCK_N,
                                              False)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            # block j's stage is free now: refill it STAGES blocks ahead
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, j + STAGES, n_blocks, kv_row, v_row, BLOCK_N, STAGES)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        acc = warpgroup_mma(p8, v_smem.index(last % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        cols = gl.arange(0, HEAD_DIM, layout=o_cols)
        v_scale = gl.load(v_scale_ptr + bh * HEAD_DIM + cols)
        out = acc * gl.expand_dims(v_scale, 0) / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
        rows = pid * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        base = out_ptr + (bh // heads).to(gl.int64) * stride_ob + (bh % heads).to(gl.int64) * stride_oh
        ptrs = base + gl.expand_dims(rows.to(gl.int64) * stride_on, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < n_q, 1))


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernel applies to these (batch, heads, tokens, head dim) tensors, else why not."""
    if gluon is None:
        return "this Triton has no Gluon Hopper ops"
    return triton8.supports(q, k, v)


def _descriptor(tensor: torch.Tensor, block: list, dtype) -> "TensorDescriptor":
    return TensorDescriptor.from_tensor(tensor, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def attend(prepared: dict, batch: int, heads: int, dim: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """triton8.attend's contract (operands from triton8.prepare with pv="fp8"), this kernel. config: (BLOCK_M,
    BLOCK_N, warps, STAGES); its BLOCK_N must be the one the operands were prepared with."""
    block_m, block_n, warps, stages = config or CONFIGS[dim]
    if block_n != prepared["block_n"]:
        raise ValueError(f"operands prepared for key blocks of {prepared['block_n']}, config has {block_n}")
    if prepared["v"].dtype != torch.float8_e4m3fn:
        raise ValueError("the Gluon kernel takes e4m3 V (triton8.prepare with pv='fp8')")
    q_desc = _descriptor(prepared["q"], [block_m, dim], gl.int8)
    k_desc = _descriptor(prepared["k"], [block_n, dim], gl.int8)
    v_desc = _descriptor(prepared["v"], [dim, block_n], gl.float8e4nv)
    grid = (-(-prepared["n_q"] // block_m), batch * heads)
    _attention_kernel[grid](q_desc, k_desc, v_desc, prepared["q_scale"], prepared["k_scale"], prepared["v_scale"],
                            out, prepared["n_q"], prepared["n_kv"], heads, prepared["nq_pad"], prepared["nkv_pad"],
                            out.stride(0), out.stride(2), out.stride(1), HEAD_DIM=dim, BLOCK_M=block_m,
                            BLOCK_N=block_n, STAGES=stages, num_warps=warps)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
              config=None) -> torch.Tensor:
    """triton8.attention's contract, through this kernel (P·V in e4m3)."""
    return triton8.attention(q, k, v, sm_scale, "fp8", config or CONFIGS[q.shape[-1]], attend=attend)
