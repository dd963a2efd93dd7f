"""The 8-bit attention scheme of triton8.py in plain torch: the same quantization of Q, K, P and V, computed with
the row's final max instead of the kernel's running one. It runs anywhere (the CPU tests check the scheme's math
with it) and is what the GPU tests compare the kernel against, beside the exact fp32 attention."""
import torch

from ..step_cache.runner import relative_error  # noqa: F401 - ‖out − ref‖ / ‖ref‖, the one the project uses
from ..quantization.kernels import FP8_MAX, INT8_MAX


def quantize_int8_rows(x: torch.Tensor):
    """(..., tokens, channels) float -> (int8 values as float, per-row scale (..., tokens, 1)): round half away
    from zero, as the kernel does."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-20)
    y = x / scale
    return torch.trunc(y + 0.5 * torch.sign(y)), scale


def quantize_int8_blocks(x: torch.Tensor, block: int):
    """(..., tokens, channels) -> (int8 values as float, scale per token (..., tokens, 1)) with one scale per `block`
    tokens (the last block may be shorter)."""
    n = x.shape[-2]
    pad = -n % block
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(-2, (-1, block))
    scale = (padded.abs().amax(dim=(-2, -1), keepdim=True) / INT8_MAX).clamp_min(1e-20)
    y = padded / scale
    scale = scale.expand(*padded.shape[:-1], 1).flatten(-3, -2)[..., :n, :]
    return torch.trunc(y + 0.5 * torch.sign(y)).flatten(-3, -2)[..., :n, :], scale


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (as float32)."""
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """K minus its mean over the tokens, per head and channel: the same softmax, a smaller int8 range."""
    return k - k.mean(dim=-2, keepdim=True)


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                        block_n: int = 128, pv: str = "fp8"):
    """(batch, heads, tokens, head dim) -> same layout, float32: attention through the 8-bit scheme (K scaled per
    `block_n` keys; P·V in e4m3 or, pv="fp16", fp16)."""
    q, k, v = (t.float() for t in (q, k, v))
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    q8, sq = quantize_int8_rows(q)
    k8, sk = quantize_int8_blocks(smooth_k(k), block_n)
    scores = (q8 @ k8.transpose(-1, -2)) * sq * sk.transpose(-1, -2) * sm_scale
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    v_scale = (v.abs().amax(dim=-2, keepdim=True) / FP8_MAX).clamp_min(1e-20)
    cast = to_e4m3 if pv == "fp8" else (lambda t: t.half().float())
    out = cast(p * FP8_MAX) @ cast(v / v_scale)
    return out * v_scale / FP8_MAX / p.sum(dim=-1, keepdim=True)


def smoothed_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """fa3_fp8.py's casts in plain torch: (Q, K - k̄, V - v̄ rounded to e4m3 over one scale per (batch, head), each
    as float32 times its scale; V's mean), of (batch, heads, tokens, head dim) tensors."""
    q, k, v = (t.float() for t in (q, k, v))
    v_mean = v.mean(dim=-2, keepdim=True)

    def cast(t):
        scale = (t.abs().amax(dim=(-2, -1), keepdim=True) / FP8_MAX).clamp_min(1e-20)
        return to_e4m3(t / scale) * scale

    return cast(q), cast(smooth_k(k)), cast(v - v_mean), v_mean


def e4m3_p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention as an fp8 kernel computes it: P (after the row max, so in (0, 1]) rounded to e4m3 for P·V, the row
    sum from the unrounded P. A shared offset in V then multiplies P's rounding error instead of cancelling."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return (to_e4m3(p) @ v.float()) / p.sum(dim=-1, keepdim=True)


def smoothed_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """fa3_fp8.py's attention: `e4m3_p_attention` over `smoothed_e4m3`'s operands, V's mean added back."""
    q8, k8, v8, v_mean = smoothed_e4m3(q, k, v)
    return e4m3_p_attention(q8, k8, v8) + v_mean


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None):
    """The float32 reference."""
    q, k, v = (t.float() for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale)
