"""Overdrive's attention in ComfyUI: an `optimized_attention_override` (ComfyUI's own seam, read by every attention
call of every model family) that sends supported calls to `torch.ops.overdrive.attention`, a video model's
self-attention to the sparse mask where Sparse Video Attention set one (`torch.ops.overdrive.video_attention`), and
every other call to the attention function ComfyUI would have used."""
import dataclasses

import torch

from ..attention import video_sparsity
from ..attention.choice import AttentionConfig, OnePerConfig, bound
from ..attention.op import attend, fits
from .comfy_call_options import ATTENTION_OVERRIDE, VIDEO_GRID, video_sparsity_of


EXACT = AttentionConfig("exact")


class OverdriveAttention(OnePerConfig):
    """The override (ComfyUI calls it as `func, q, k, v, heads, ...`)."""
    overdrive_attention = True

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def fallback():
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        video = self.config.video
        if mask is not None or attn_precision == torch.float32 or not (q.is_cuda or video is not None):
            return fallback()
        if skip_reshape:
            q4, k4, v4 = q, k, v
        else:
            dim = q.shape[-1] // heads
            q4, k4, v4 = (t.view(t.shape[0], -1, heads, dim).transpose(1, 2) for t in (q, k, v))
        if not fits(q4, k4, v4):
            return fallback()
        grid = (kwargs.get("transformer_options") or {}).get(VIDEO_GRID)
        # CUDA, or the CPU (where the tests compare it): elsewhere the mask would be SDPA's whole boolean mask
        per_frame = video_sparsity.applies(video, q4, k4, grid) if video is not None and q.device.type in (
            "cuda", "cpu") else 0
        if per_frame:
            out = video_sparsity.video_attention(q4, k4, v4, per_frame, video.window, video.sink)
        elif not q.is_cuda:
            return fallback()
        else:
            # A model marks the calls 8-bit attention must not take (ComfyUI 0.33: Wan's image cross-attention, where
            # SageAttention made NaNs): the 16-bit kernels still may.
            config = EXACT if kwargs.get("low_precision_attention", True) is False else self.config
            out = attend(q4, k4, v4, config)
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)


def install_attention(patcher, config: AttentionConfig) -> str:
    """Put Overdrive's attention on a (cloned) ModelPatcher; returns what was done, for the log. Compile Model's
    `exact` does not replace an Overdrive attention already there (Quantize Model's measures the same kernels)."""
    options = patcher.model_options.setdefault("transformer_options", {})
    current = options.get(ATTENTION_OVERRIDE)
    ours = getattr(current, "overdrive_attention", False)
    video = video_sparsity_of(current) if ours else None  # Sparse Video Attention's mask stays with the model
    if config.mode == "sdpa" and video is None:
        if ours:
            del options[ATTENTION_OVERRIDE]
        return "attention: SDPA (8-bit attention off)"
    if current is not None and not ours:
        return "attention: another node already overrides attention, so Overdrive's attention is off"
    if ours and config.mode == "exact" and current.config.mode != "sdpa":
        return f"attention: {current.config.mode}, as set before"
    options[ATTENTION_OVERRIDE] = OverdriveAttention(dataclasses.replace(config, video=video))
    if config.mode == "sdpa":
        return "attention: SDPA (8-bit attention off) beside the sparse video attention"
    kinds = "16-bit kernels" if config.mode == "exact" else "backends"
    return (f"attention: {config.mode} ({kinds} where they measure faster than SDPA within "
            f"{bound(config.mode == 'exact', config):.1%} error per call, chosen per shape at its first call)")


def install_video_sparsity(patcher, sparsity) -> bool:
    """Sparse Video Attention's mask on a (cloned) ModelPatcher, beside the attention settings already there (SDPA for
    every other call where there are none); False where another node overrides attention."""
    options = patcher.model_options.setdefault("transformer_options", {})
    current = options.get(ATTENTION_OVERRIDE)
    if current is not None and not getattr(current, "overdrive_attention", False):
        return False
    config = current.config if current is not None else AttentionConfig("sdpa")
    options[ATTENTION_OVERRIDE] = OverdriveAttention(dataclasses.replace(config, video=sparsity))
    return True
