"""Wan 2.1 / 2.2 (ComfyUI's `WanModel`, diffusers' `WanTransformer3DModel`): one stack of attention blocks over the
video tokens."""
import torch

from ..parallel.split_rules import DiffusersSplit, PerToken, SplitFamily, double_blocks, patches
from .family import BlockStack, BuiltinModel, Family, HostSyncFix, register


def time_embedding(dim: int, position: torch.Tensor) -> torch.Tensor:
    """ComfyUI's `sinusoidal_embedding_1d` with its frequency exponents made on the position's device. ComfyUI's makes
    them on the CPU and copies them over at every model call: a copy from pageable memory, which waits until the GPU
    has drained, so the GPU then idles while the host runs the model's preamble (one such wait a call,
    bench/EXPERIMENTS.md). The same operations on the same values (integers below 2**24 are exact in float32): the
    output equals ComfyUI's bit for bit."""
    assert dim % 2 == 0, f"an even embedding width is needed, got {dim}"  # as ComfyUI's asserts
    half = dim // 2
    position = position.float()
    exponents = torch.arange(half, device=position.device, dtype=torch.float32).div(half)
    angles = torch.outer(position, torch.pow(10000, -exponents))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


_WHY = "ComfyUI's copies its frequencies from the CPU at every model call, which waits for the GPU to drain"

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN_WAN22 = BuiltinModel(  # Wan 2.2 TI2V-5B, which ComfyUI loads as WAN22_T2V (48-channel latents, Wan 2.2 VAE)
    "wan22",
    "WAN22_T2V",
    dict(image_model="wan2.1", model_type="t2v", dim=3072, out_dim=48, in_dim=48, num_heads=24, ffn_dim=14336,
         num_layers=30, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
         cross_attn_norm=True, eps=1e-6),
    dict(dim=256, num_heads=2, ffn_dim=512, num_layers=2),
    "wan22", dict(tokens=512, width=4096), dict(channels=48, spatial=16, frames=True, video=True),
    dict(cfg=5.0, steps=20))

BUILTIN_WAN22_14B = BuiltinModel(  # Wan 2.2 A14B's experts (and Wan 2.1 14B), which ComfyUI loads as WAN21_T2V
    "wan22_14b",
    "WAN21_T2V",               # (16-channel latents, Wan 2.1 VAE); the CPU suite runs Wan's blocks as wan22
    dict(image_model="wan2.1", model_type="t2v", dim=5120, out_dim=16, in_dim=16, num_heads=40, ffn_dim=13824,
         num_layers=40, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
         cross_attn_norm=True, eps=1e-6),
    dict(dim=256, num_heads=2, ffn_dim=512, num_layers=2),
    "wan21", dict(tokens=512, width=4096), dict(channels=16, spatial=8, frames=True, video=True),
    dict(cfg=5.0, steps=20), cpu_suite=False)

# Video steps move more between full steps than the MMDiT's: the learned Wan-layout model needs a lower threshold to
# stay 40 dB from eager (bench/README.md, fidelity table).
STEP_CACHE_THRESHOLD = 0.15

FAMILY = register(Family("wan", frozenset({"WanModel"}), (
    BlockStack("blocks", streams=(("x", 0),), returns=("x",)),
), host_sync_fixes=tuple(HostSyncFix(module, "sinusoidal_embedding_1d", time_embedding, _WHY,
                                     probe=(16, torch.tensor([0.0, 0.5, 999.0])))
                         for module in ("comfy.ldm.wan.model", "comfy.ldm.wan.model_animate")),
   display_name="Wan", step_cache_threshold=STEP_CACHE_THRESHOLD, static_under_auto=True, video_grid=True,
   builtin_models=(BUILTIN_WAN22, BUILTIN_WAN22_14B), sequence_splits=(
    SplitFamily(lambda m: double_blocks(m.blocks), lambda m: m.blocks[0].self_attn.num_heads,
                lambda m: tuple(m.patch_size), joint=False, pe_dim=1, vec_per_token=True),)))

DIFFUSERS = register(Family("wan", frozenset({"WanTransformer3DModel"}), (
    BlockStack("blocks", streams=(("hidden_states", 0),), returns=("hidden_states",)),
), noise_timestep=1000.0, float_layers=(
    # diffusers' Wan casts the timestep to `next(time_embedder.parameters()).dtype`: with both its linears quantized
    # (whose weights are buffers) that raises StopIteration. Two GEMVs a call: nothing to gain from 8 bits.
    (r"condition_embedder\.time_embedder\.", "diffusers' Wan reads the float dtype from this module's parameters"),
), display_name="Wan", step_cache_threshold=STEP_CACHE_THRESHOLD, sequence_splits=(
    DiffusersSplit(patches, text_first=None, per_token=(PerToken("rotary_emb", 1), PerToken("temb", 1))),)))
