"""FlashAttention-3's Hopper forward kernel (the `fa3-fwd` wheel: prebuilt sm_90a kernels, no compiler at run time),
in bf16; fp16 inputs (a model ComfyUI runs in fp16) are rounded to bf16 and the output cast back. Its result is SDPA's
to bf16 rounding, so the chooser counts it among the 16-bit kernels (`exact` mode, held to EXACT_MAX_ERROR, measured
with the casts) and takes it wherever it measures faster. The wheel registers the kernel as a torch custom op with
a fake implementation, so torch.compile traces it as one call and CUDA graphs record it. Installed by
scripts/install.sh on Hopper only; absent, this backend says so and SDPA runs.
"""
from __future__ import annotations

import torch

try:
    import fa3_fwd_interface  # noqa: F401 - registers torch.ops.fa3_fwd
    _missing = None
except Exception as error:  # noqa: BLE001 - not installed, or its native module does not load here
    _missing = f"fa3-fwd is not importable ({type(error).__name__}: {str(error)[:120]})"

MAX_HEAD_DIM = 256


def unavailable(q: torch.Tensor) -> str | None:
    """None where the wheel's kernels run on q's device, else why not."""
    if _missing is not None:
        return _missing
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "FlashAttention-3's kernels are built for Hopper (sm_90) only"
    return None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None where the bf16 kernel runs (batch, heads, tokens, head dim) q, k, v, else why not."""
    missing = unavailable(q)
    if missing is not None:
        return missing
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        return f"the fa3-fwd wheel runs bf16 (and fp16 through bf16), not {q.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim): the kernel reads and writes the
    tokens-major layout, which is what the backends return, so the transposes are views (a cast keeps the strides)."""
    dtype = q.dtype
    if dtype != torch.bfloat16:  # the wheel has no fp16 kernels
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = torch.ops.fa3_fwd._flash_attn_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0]
    return out.to(dtype)  # itself where already bf16
