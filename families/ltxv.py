"""LTX-Video (ComfyUI's `LTXVModel`, Lightricks' 2B and 13B video DiTs; diffusers' `LTXVideoTransformer3DModel`): one
stack of attention blocks over the video tokens, each a self-attention, a cross-attention over the T5 prompt and a gated
MLP; ComfyUI's block updates its input in place and returns it. LTX-2 (`LTXAVModel`, audio and video: `LTX2`) runs the
same patchifier; its blocks take and return the video and audio tokens as one tuple, a BlockStack's `parts`, and attend
across the two (tests/test_ltx2.py)."""
from types import SimpleNamespace

import torch

from .family import BlockStack, BuiltinModel, Family, HostSyncFix, register


def latent_coords(self, latent_num_frames, latent_height, latent_width, batch_size, device):
    """ComfyUI's `Patchifier.get_latent_coords` with each patch's end made by adding the patch size per axis, where
    ComfyUI's copies a tensor of the patch sizes from the CPU at every model call. The same integers: the output equals
    ComfyUI's bit for bit ((batch, 3, tokens), or (batch, 3, tokens, 2) with each patch's start and end)."""
    sizes = (latent_num_frames, latent_height, latent_width)
    axes = [torch.arange(0, size, step, device=device) for size, step in zip(sizes, self._patch_size)]
    start = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # (3, frames, height, width)

    def per_sample(grid):
        return grid.flatten(1).unsqueeze(0).repeat(batch_size, 1, 1)
    if not self.start_end:
        return per_sample(start)
    end = torch.stack([coords + step for coords, step in zip(start, self._patch_size)], dim=0)
    return torch.stack((per_sample(start), per_sample(end)), dim=-1)


def pixel_coords(latent_coords, scale_factors, causal_fix=False):
    """ComfyUI's `latent_to_pixel_coords` with each axis scaled by its Python factor, where ComfyUI's copies a tensor of
    the factors from the CPU at every model call. Same products in the same dtype: bit for bit ComfyUI's output."""
    pixel = torch.stack([latent_coords[:, axis] * factor for axis, factor in enumerate(scale_factors)], dim=1)
    if causal_fix:  # the first frame's temporal scale is 1 (causal VAE), as ComfyUI's
        pixel[:, 0, ...] = (pixel[:, 0, ...] + 1 - scale_factors[0]).clamp(min=0)
    return pixel


_WHY = "ComfyUI's copies a small tensor from the CPU at every model call, which waits for the GPU to drain"

_TEXT_ONLY = "runs on the prompt's tokens only (few rows, little to gain) and its 8-bit error reaches every block"

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN_LTXV = BuiltinModel(  # LTX-Video 13B (0.9.7/0.9.8): 48 blocks of 32 heads x 128; detection reads depth and widths
    "ltxv",
    "LTXV", dict(image_model="ltxv", num_layers=48, attention_head_dim=128, cross_attention_dim=4096),
    dict(num_layers=2, attention_head_dim=8, cross_attention_dim=256),
    "ltxv", dict(tokens=128, width=4096, prompt_share=0.25),
    dict(channels=128, spatial=32, frames=True, video=True, temporal=8),
    dict(cfg=3.0, steps=20))

BUILTIN_LTX2 = BuiltinModel(  # LTX-2 (18.9 B): 48 blocks, each a video stream (32 heads x 128) and an audio stream
    # (32 x 64) with cross-attention between them; Gemma 3's output through two connectors, video and audio side
    # by side (2 x 3,840 wide), which pad it with learned registers to at least 1,024 tokens. Its latent is LTXV
    # Concat AV Latent's: the video's (LTX-Video's VAE compression) and the audio's (8 channels x 16 mel bins, 25
    # latents a second of video at 25 fps), packed as one NestedTensor
    "ltx2",
    "LTXAV", dict(image_model="ltxav", num_layers=48, attention_head_dim=128, cross_attention_dim=4096),
    dict(num_layers=2, attention_head_dim=4, cross_attention_dim=128, audio_attention_head_dim=4,
         audio_num_attention_heads=2, audio_cross_attention_dim=8),
    "ltxv", dict(tokens=1024, width=7680),
    dict(channels=128, spatial=32, frames=True, video=True, temporal=8,
         audio=dict(channels=8, bins=16, per_second=25, frame_rate=25)),
    dict(cfg=3.0, steps=20),
    file_config=("audio_attention_head_dim", "audio_num_attention_heads", "audio_cross_attention_dim"))

FAMILY = register(Family("ltxv", frozenset({"LTXVModel"}), (
    BlockStack("transformer_blocks", streams=(("x", 0),), returns=("x",)),
), float_layers=(
    # 768x512 (4,992 tokens against the prompt's 128), fp8 with QuantizeModel's defaults, one model call against bf16:
    # 6.2e-2, of which 3.9e-2 with the caption projection alone and 2.9e-2 / 1.8e-2 with the cross-attention's
    # value / key projections alone (bench/results/2026-11-27_h100_ltxv_fp8_layer_groups.json).
    (r"caption_projection\.", _TEXT_ONLY),
    (r"transformer_blocks\.\d+\.attn2\.to_[kv]$", _TEXT_ONLY),
), host_sync_fixes=(
    HostSyncFix("comfy.ldm.lightricks.symmetric_patchifier", "Patchifier.get_latent_coords", latent_coords, _WHY,
                probe=(SimpleNamespace(_patch_size=(1, 2, 2), start_end=True), 3, 4, 6, 2, "cpu")),
    HostSyncFix("comfy.ldm.lightricks.model", "latent_to_pixel_coords", pixel_coords, _WHY,
                probe=(torch.arange(2 * 3 * 5 * 2).reshape(2, 3, 5, 2), (8, 32, 32), True)),
), display_name="LTX-Video", builtin_models=(BUILTIN_LTXV,)))

DIFFUSERS = register(Family("ltxv", frozenset({"LTXVideoTransformer3DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0),), returns=("hidden_states",)),
), noise_timestep=1000.0, display_name="LTX-Video"))

# LTX-2: its prompt reaches the video and the audio tokens through a caption projection and a cross-attention each.
LTX2 = register(Family("ltx2", frozenset({"LTXAVModel"}), (
    BlockStack("transformer_blocks", streams=(("x", 0),), returns=("x",), parts=(("x", ("video", "audio")),),
          options=("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")),
), float_layers=(
    (r"(audio_)?caption_projection\.", _TEXT_ONLY),
    (r"transformer_blocks\.\d+\.(audio_)?attn2\.to_[kv]$", _TEXT_ONLY),
), host_sync_fixes=FAMILY.host_sync_fixes, display_name="LTX-2",
   builtin_models=(BUILTIN_LTX2,)))
