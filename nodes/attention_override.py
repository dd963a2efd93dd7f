"""Overdrive's attention in ComfyUI: an `optimized_attention_override` (ComfyUI's own seam, read by every attention
call of every model family) that sends supported calls to `torch.ops.overdrive.attention` and every other call to
the attention function ComfyUI would have used."""
import torch

from ..attention.choice import AttentionConfig, OnePerConfig
from ..attention.op import attend, fits
from ..compiler.regions import ATTENTION_OVERRIDE


class OverdriveAttention(OnePerConfig):
    """The override (ComfyUI calls it as `func, q, k, v, heads, ...`)."""
    overdrive_attention = True

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def fallback():
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None or attn_precision == torch.float32 or not q.is_cuda:
            return fallback()
        if skip_reshape:
            q4, k4, v4 = q, k, v
        else:
            dim = q.shape[-1] // heads
            q4, k4, v4 = (t.view(t.shape[0], -1, heads, dim).transpose(1, 2) for t in (q, k, v))
        if not fits(q4, k4, v4):
            return fallback()
        out = attend(q4, k4, v4, self.config)
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)


def install_attention(patcher, config: AttentionConfig) -> str:
    """Put Overdrive's attention on a (cloned) ModelPatcher; returns what was done, for the log."""
    options = patcher.model_options.setdefault("transformer_options", {})
    current = options.get(ATTENTION_OVERRIDE)
    if config.mode == "sdpa":
        if getattr(current, "overdrive_attention", False):
            del options[ATTENTION_OVERRIDE]
        return "attention: SDPA (8-bit attention off)"
    if current is not None and not getattr(current, "overdrive_attention", False):
        return "attention: another node already overrides attention, so Overdrive's 8-bit attention is off"
    options[ATTENTION_OVERRIDE] = OverdriveAttention(config)
    return (f"attention: {config.mode} (8-bit backends where they measure faster than SDPA within "
            f"{config.max_error:.1%} error per call, chosen per shape at its first call)")
