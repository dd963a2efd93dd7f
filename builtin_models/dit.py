"""Built-in DiT families (Flux.1-dev, Flux.2, Chroma, Qwen-Image, Wan 2.2, Z-Image, SD3.5, LTX-Video, LTX-2):
diffusion-model files for UNETLoader and VAE files for VAELoader, with fixed-seed random weights, in exactly the layout
ComfyUI loads.

The layout is read off ComfyUI's own classes, built on the meta device (no memory, no weights) at the config
that ComfyUI's detection (comfy/model_detection.py) returns for them; `layout` checks that round trip, so a file
ComfyUI would detect as another model is never written. So these families need ComfyUI importable (the SD
checkpoints in checkpoint.py do not).

"tiny" is as small as detection allows: several families fix their width in detection (Flux 3072, Flux.2 6144,
Qwen-Image 3072, Z-Image 3840), so only their depth shrinks (one block of each kind: Flux 0.5 B parameters, Flux.2
2.3 B, Qwen-Image 0.4 B, Z-Image 1 B); Wan, SD3.5 and LTX-Video read their width from the weights and shrink to a few
million, and LTX-2 reads its audio stream's widths from the file's metadata, as its released files carry them.
"quarter" keeps the full width with a quarter of the blocks, for benchmarks of models too large to write in their time.
Text encoders are not built: ComfyUI builds them at fixed full sizes (T5-XXL alone is 4.7 B parameters);
the `OverdriveBuiltinConditioning` node gives these models conditioning of the right shape instead.
"""
import contextlib
import hashlib
import io
import json
import math
import pathlib
import re
from typing import Dict, NamedTuple, Optional

import torch

from ..comfy_host.latents import latent_parts
from ..core.storage import cache_dir
from .tensors import Specs, TensorSpec
from .weights import SMALL_GAIN, make_tensor
from .writer import DTYPE_NAMES, write_safetensors

GENERATOR_VERSION = 2

# The layers that make a DiT block's shift, scale and gate (adaLN) from the timestep and text embedding. At fan-in
# scale their gates come out ~N(0, 1), and Flux's 57 blocks amplify any rounding difference into a 40 % error of one
# model call (H200, bf16, compiled vs eager: bench/results/2026-11-25_h200_flux_1024.json); trained DiTs keep gates
# small (adaLN-Zero starts them at 0), so these weights are drawn 10x smaller.
MODULATION = re.compile(r"(^|\.)(img_mod|txt_mod|modulation|adaLN_modulation|time_projection|norm_out)(\.|$)"
                        r"|(^|\.)(norm1|norm1_context|norm)\.linear\."  # diffusers' Flux adaLN layers
                        r"|(^|\.)adaln_single\.linear\."  # LTX-Video's (its blocks add a small learned table)
                        r"|(^|\.)distilled_guidance_layer\.out_proj\."  # Chroma's approximator, every block's
                        r"|(^|\.)(double|single)_stream_modulation(_img|_txt)?\.")  # Flux.2's global ones
MODULATION_GAIN = SMALL_GAIN


class BuiltinFamily(NamedTuple):
    model_class: str     # the comfy.supported_models class detection must pick
    full: dict           # the unet_config of the real model, as detection returns it
    tiny: dict           # what "tiny" overrides
    vae: str             # key of VAES
    cond: dict           # conditioning shapes: context (tokens, width), pooled width (None: the key without a
                         # vector), guidance, and the prompt's share of the tokens where the encoder also gives an
                         # attention mask (LTX-Video's T5 pads to 128 tokens and masks the padding; its model
                         # requires the mask)
    latent: dict         # latent channels, the VAE's spatial compression, whether latents have a time axis, and
                         # whether that axis holds a video's frames (Qwen-Image's has one image frame), the VAE's
                         # temporal compression ("temporal", 4 unless given), and ComfyUI's empty-latent node where
                         # Flux's example graph (EmptySD3LatentImage) would give the wrong shape ("node")
    sampling: dict       # CFG and steps as the family is usually sampled (Flux.1-dev and Z-Image Turbo are
                         # guidance-distilled: CFG 1, one model call a step)
    cpu_suite: bool = True  # whether the CPU test suite runs the tiny file (Flux.2's, 2.3 B parameters, is the GPU
                            # tests' alone: tests/test_flux2_gpu.py)
    file_config: tuple = ()  # unet_config keys that detection reads from the file's metadata ({"config":
                             # {"transformer": {...}}}), not from the weights' shapes (LTX-2's audio stream)


FAMILIES: Dict[str, BuiltinFamily] = {
    "flux": BuiltinFamily(
        "Flux",
        dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
             hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56],
             theta=10000, qkv_bias=True, guidance_embed=True, patch_size=2, txt_ids_dims=[], yak_mlp=False,
             txt_norm=False),
        dict(depth=1, depth_single_blocks=1),
        "flux_ae", dict(tokens=256, width=4096, pooled=768, guidance=3.5), dict(channels=16, spatial=8, frames=False),
        dict(cfg=1.0, steps=20)),
    "chroma": BuiltinFamily(  # Chroma1 (Flux.1-schnell's blocks without per-block modulation layers: one approximator
        # makes every block's modulation from the timestep), T5-XXL only and unpadded, sampled with real CFG
        "Chroma",
        dict(image_model="chroma", in_channels=64, out_channels=64, in_dim=64, out_dim=3072, hidden_dim=5120,
             n_layers=5, hidden_size=3072, context_in_dim=4096, mlp_ratio=4.0, num_heads=24, depth=19,
             depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, qkv_bias=True, patch_size=2,
             txt_ids_dims=[], vec_in_dim=None),
        dict(depth=1, depth_single_blocks=1),
        "flux_ae", dict(tokens=64, width=4096, pooled=None), dict(channels=16, spatial=8, frames=False),
        dict(cfg=4.0, steps=26)),
    "flux2": BuiltinFamily(  # Flux.2 [dev] (32 B): 8 double and 48 single blocks at 48 heads x 128, their modulations
        # made once per call by three global layers; Mistral Small 3.1's three stacked hidden layers as the text (15,360
        # wide, padded to 512 tokens by ComfyUI); guidance-distilled. Detection fixes the heads and the rotary axes,
        # so the width stays 6,144 and the tiny file is one block of each kind (2.3 B parameters)
        "Flux2",
        dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
             hidden_size=6144, mlp_ratio=3.0, num_heads=48, depth=8, depth_single_blocks=48, axes_dim=[32, 32, 32, 32],
             theta=2000, qkv_bias=False, guidance_embed=True, patch_size=1, txt_ids_dims=[3], yak_mlp=False,
             txt_norm=False, global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
             ref_index_scale=10.0),
        dict(depth=1, depth_single_blocks=1),
        "flux2_ae", dict(tokens=512, width=15360, pooled=None, guidance=4.0),
        dict(channels=128, spatial=16, frames=False, node="EmptyFlux2LatentImage"),
        dict(cfg=1.0, steps=28), cpu_suite=False),
    "qwen_image": BuiltinFamily(
        "QwenImage", dict(image_model="qwen_image", in_channels=64, num_layers=60), dict(num_layers=2),
        "wan21", dict(tokens=64, width=3584), dict(channels=16, spatial=8, frames=True, video=False),  # Wan 2.1 VAE
        dict(cfg=2.5, steps=20)),
    "wan22": BuiltinFamily(  # Wan 2.2 TI2V-5B, which ComfyUI loads as WAN22_T2V (48-channel latents, Wan 2.2 VAE)
        "WAN22_T2V",
        dict(image_model="wan2.1", model_type="t2v", dim=3072, out_dim=48, in_dim=48, num_heads=24, ffn_dim=14336,
             num_layers=30, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
             cross_attn_norm=True, eps=1e-6),
        dict(dim=256, num_heads=2, ffn_dim=512, num_layers=2),
        "wan22", dict(tokens=512, width=4096), dict(channels=48, spatial=16, frames=True, video=True),
        dict(cfg=5.0, steps=20)),
    "wan22_14b": BuiltinFamily(  # Wan 2.2 A14B's experts (and Wan 2.1 14B), which ComfyUI loads as WAN21_T2V
        "WAN21_T2V",               # (16-channel latents, Wan 2.1 VAE); the CPU suite runs Wan's blocks as wan22
        dict(image_model="wan2.1", model_type="t2v", dim=5120, out_dim=16, in_dim=16, num_heads=40, ffn_dim=13824,
             num_layers=40, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
             cross_attn_norm=True, eps=1e-6),
        dict(dim=256, num_heads=2, ffn_dim=512, num_layers=2),
        "wan21", dict(tokens=512, width=4096), dict(channels=16, spatial=8, frames=True, video=True),
        dict(cfg=5.0, steps=20), cpu_suite=False),
    "zimage": BuiltinFamily(
        "ZImage",
        dict(image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=30,
             qk_norm=True, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
             rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
             pad_tokens_multiple=32),
        dict(n_layers=2),
        "flux_ae", dict(tokens=64, width=2560), dict(channels=16, spatial=8, frames=False),
        dict(cfg=1.0, steps=8)),
    "sd35": BuiltinFamily(  # SD3.5 Large: 38 joint blocks of 64 x 38 channels
        "SD3",
        dict(in_channels=16, patch_size=2, out_channels=16, depth=38, input_size=None, adm_in_channels=2048,
             context_embedder_config={"target": "torch.nn.Linear",
                                      "params": {"in_features": 4096, "out_features": 2432}},
             num_patches=36864, pos_embed_max_size=192, qk_norm="rms", pos_embed_scaling_factor=None,
             x_block_self_attn_layers=[]),
        dict(depth=2, context_embedder_config={"target": "torch.nn.Linear",
                                               "params": {"in_features": 4096, "out_features": 128}},
             num_patches=1024, pos_embed_max_size=32),
        "flux_ae", dict(tokens=154, width=4096, pooled=2048), dict(channels=16, spatial=8, frames=False),
        dict(cfg=4.5, steps=20)),
    "ltxv": BuiltinFamily(  # LTX-Video 13B (0.9.7/0.9.8): 48 blocks of 32 heads x 128; detection reads depth and widths
        "LTXV", dict(image_model="ltxv", num_layers=48, attention_head_dim=128, cross_attention_dim=4096),
        dict(num_layers=2, attention_head_dim=8, cross_attention_dim=256),
        "ltxv", dict(tokens=128, width=4096, prompt_share=0.25),
        dict(channels=128, spatial=32, frames=True, video=True, temporal=8),
        dict(cfg=3.0, steps=20)),
    "ltx2": BuiltinFamily(  # LTX-2 (18.9 B): 48 blocks, each a video stream (32 heads x 128) and an audio stream
        # (32 x 64) with cross-attention between them; Gemma 3's output through two connectors, video and audio side
        # by side (2 x 3,840 wide), which pad it with learned registers to at least 1,024 tokens. Its latent is LTXV
        # Concat AV Latent's: the video's (LTX-Video's VAE compression) and the audio's (8 channels x 16 mel bins, 25
        # latents a second of video at 25 fps), packed as one NestedTensor
        "LTXAV", dict(image_model="ltxav", num_layers=48, attention_head_dim=128, cross_attention_dim=4096),
        dict(num_layers=2, attention_head_dim=4, cross_attention_dim=128, audio_attention_head_dim=4,
             audio_num_attention_heads=2, audio_cross_attention_dim=8),
        "ltxv", dict(tokens=1024, width=7680),
        dict(channels=128, spatial=32, frames=True, video=True, temporal=8,
             audio=dict(channels=8, bins=16, per_second=25, frame_rate=25)),
        dict(cfg=3.0, steps=20),
        file_config=("audio_attention_head_dim", "audio_num_attention_heads", "audio_cross_attention_dim")),
}

CPU_SUITE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.cpu_suite)

# VAE configs as ComfyUI's comfy.sd.VAE builds them from the file's shapes.
VAES = {
    # Flux's ae.safetensors (also SD3.5's and Z-Image's layout): the SD autoencoder with 16 latent channels and
    # no quant convs.
    "flux_ae": ("sd", dict(double_z=True, z_channels=16, resolution=256, in_channels=3, out_ch=3, ch=128,
                           ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0)),
    # Flux.2's: the autoencoder with quant convs (ComfyUI's AutoencoderKL) and 32 latent channels, whose latents it
    # patchifies 2x2 and normalises with the file's batch-norm statistics (128 channels at 16x).
    "flux2_ae": ("sd_kl", dict(double_z=True, z_channels=32, resolution=256, in_channels=3, out_ch=3, ch=128,
                            ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0,
                            batch_norm_latent=True)),
    "wan21": ("wan21", dict(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True], image_channels=3, dropout=0.0)),
    "wan22": ("wan22", dict(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True], dropout=0.0)),
    # LTX-Video's causal video VAE as ComfyUI builds it for the 0.9.5+ files (version 2: it picks the version from the
    # weights' shapes and fixes every width, so it has no tiny size).
    "ltxv": ("ltxv", dict(version=2)),
}
# The Wan 2.1 VAE reads its width from the weights; LTX-Video's smallest is its first version (0.4 B parameters against
# 1.2 B), which ComfyUI also loads for these latents; the others fix their width.
TINY_VAE = {"wan21": dict(dim=16), "ltxv": dict(version=0)}


def unet_config(family: str, size: str) -> dict:
    """"full", "tiny", or "quarter": the full width with a quarter of each stack of blocks "tiny" shortens (a model too
    large to write and load in a benchmark's time, timed per block as the full one runs)."""
    f = FAMILIES[family]
    if size == "quarter":
        return {**f.full, **{key: max(1, f.full[key] // 4) for key in f.tiny if "depth" in key or "layers" in key}}
    return {**f.full, **(f.tiny if size == "tiny" else {})}


def _import_comfy():
    try:
        import comfy.model_detection  # noqa: F401
        import comfy.supported_models  # noqa: F401
    except ImportError as e:
        raise RuntimeError("The built-in DiT models are laid out by ComfyUI's own classes: run inside ComfyUI, or "
                           "put ComfyUI's folder on sys.path (overdrive.harness.inprocess.import_comfy does).") from e
    import comfy
    return comfy


def _specs(module: torch.nn.Module) -> Specs:
    """Every persistent tensor: matrices and kernels fan-in normal (modulation layers MODULATION_GAIN of that),
    biases near 0, other vectors (norm scales, RMSNorm gammas) near 1."""
    out = []
    for key, t in module.state_dict(keep_vars=True).items():
        name = key.rsplit(".", 1)[-1]
        init = "normal" if t.ndim > 1 else ("bias" if name == "bias" else "ones")
        if init == "normal" and MODULATION.search(key):
            init = "small"
        out.append(TensorSpec(key, tuple(t.shape), init))
    return out


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


@contextlib.contextmanager
def layers_with_weights():
    """ComfyUI's layers built with their weights: under dynamic VRAM its layers leave them unset until a state dict
    loads (comfy.ops), and a built-in model is laid out and initialised from its modules' own tensors."""
    import comfy.memory_management
    enabled = getattr(comfy.memory_management, "aimdo_enabled", False)
    comfy.memory_management.aimdo_enabled = False
    try:
        yield
    finally:
        comfy.memory_management.aimdo_enabled = enabled


def build_model(family: str, size: str, dtype: torch.dtype, device, overrides: Optional[dict] = None):
    """ComfyUI's BaseModel of the family (its weights uninitialised), built on `device` through the model config that
    ComfyUI's detection picks for the family's unet_config (with `overrides`: the learned reference models' own
    widths and depths); in `dtype` where the family's code asks for it (some layers are float32 by design: Wan's patch
    embedding)."""
    comfy = _import_comfy()
    cfg = {**unet_config(family, size), **(overrides or {})}
    model_config = comfy.model_detection.model_config_from_unet_config(dict(cfg))
    expected = FAMILIES[family].model_class
    if type(model_config).__name__ != expected:
        raise AssertionError(f"{family}/{size}: ComfyUI picks {type(model_config).__name__} for {cfg}, not {expected}")
    model_config.set_inference_dtype(dtype, None)
    with torch.device(device), _quiet(), layers_with_weights():
        return model_config.get_model({}, "", device=device)


def model_layout(family: str, size: str) -> Specs:
    """The diffusion model's tensors, checked to round-trip through ComfyUI's detection to the same class."""
    comfy = _import_comfy()
    cfg, expected = unet_config(family, size), FAMILIES[family].model_class
    specs = _specs(build_model(family, size, torch.bfloat16, "meta").diffusion_model)
    # The round trip: what detection reads back from these shapes (and the file's metadata) must pick the same class,
    # same config.
    meta = {s.key: torch.empty(s.shape, device="meta") for s in specs}
    detected = comfy.model_detection.detect_unet_config(meta, "", metadata=file_metadata(family, size))
    picked = comfy.model_detection.model_config_from_unet_config(detected, meta)
    differing = {k: (v, detected.get(k)) for k, v in cfg.items() if _norm(detected.get(k)) != _norm(v)}
    if type(picked).__name__ != expected or differing:
        raise AssertionError(f"{family}/{size}: detection reads {type(picked).__name__} back, differing {differing}")
    return specs


def file_metadata(family: str, size: str) -> dict:
    """The safetensors metadata that tells detection what the weights' shapes do not (empty for most families)."""
    cfg = unet_config(family, size)
    transformer = {key: cfg[key] for key in FAMILIES[family].file_config if key in cfg}
    return {"config": json.dumps({"transformer": transformer})} if transformer else {}


def _norm(value):
    return list(value) if isinstance(value, tuple) else value


def vae_layout(name: str, size: str) -> Specs:
    comfy = _import_comfy()
    kind, cfg = VAES[name]
    cfg = {**cfg, **(TINY_VAE.get(name, {}) if size == "tiny" else {})}
    with torch.device("meta"), _quiet(), layers_with_weights():
        if kind == "sd_kl":
            import comfy.ldm.models.autoencoder
            module = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=cfg, embed_dim=cfg["z_channels"])
        elif kind == "sd":
            import comfy.ldm.models.autoencoder
            module = comfy.ldm.models.autoencoder.AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": cfg},
                decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": cfg})
        elif kind == "wan21":
            import comfy.ldm.wan.vae
            module = comfy.ldm.wan.vae.WanVAE(**cfg)
        elif kind == "ltxv":
            import comfy.ldm.lightricks.vae.causal_video_autoencoder as ltxv_vae
            module = ltxv_vae.VideoVAE(**cfg)
        else:
            import comfy.ldm.wan.vae2_2
            module = comfy.ldm.wan.vae2_2.WanVAE(**cfg)
    return _specs(module)


def default_directory() -> pathlib.Path:
    return cache_dir("dit")


def _write(path: pathlib.Path, specs: Specs, seed: int, dtype: torch.dtype, tag: str,
           metadata: Optional[dict] = None) -> pathlib.Path:
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    by_key = {s.key: s for s in specs}
    write_safetensors(path, [(s.key, s.shape) for s in specs], dtype,
                      make=lambda key: make_tensor(by_key[key], seed, dtype),
                      metadata={**(metadata or {}), "overdrive_generated": tag,
                                "overdrive_generator_version": str(GENERATOR_VERSION)})
    return path


def _name(kind: str, what: str, size: str, seed: int, dtype: torch.dtype, specs: Specs) -> str:
    spec = [GENERATOR_VERSION, kind, what, size, seed, DTYPE_NAMES[dtype], specs]
    digest = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:8]
    return f"overdrive-{what}-{kind}-{size}-s{seed}-{digest}.safetensors"


def diffusion_model_name(family: str, size: str, seed: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """The file name ensure_diffusion_model gives these arguments."""
    return _name("dit", family, size, seed, dtype, model_layout(family, size))


def ensure_diffusion_model(family: str, size: str, seed: int, directory: pathlib.Path,
                           dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """A diffusion-model file (UNETLoader's `models/diffusion_models`), generated once; same arguments, same bytes."""
    specs = model_layout(family, size)
    return _write(directory / _name("dit", family, size, seed, dtype, specs), specs, seed, dtype,
                  f"{family}/{size}/{seed}", file_metadata(family, size))


def ensure_vae(family: str, size: str, seed: int, directory: pathlib.Path,
               dtype: Optional[torch.dtype] = torch.bfloat16) -> pathlib.Path:
    """The family's VAE file (VAELoader's `models/vae`)."""
    name = FAMILIES[family].vae
    specs = vae_layout(name, size)
    return _write(directory / _name("vae", name, size, seed, dtype, specs), specs, seed, dtype, f"vae/{name}/{size}")


def conditioning(family: str, seed: int, tokens: int = 0) -> list:
    """ComfyUI CONDITIONING ([[cross_attn, extras]]) of the shapes the family's text encoders give, fixed-seed
    random: what CLIP Text Encode would hand a built-in model whose text encoders were random too."""
    cond = FAMILIES[family].cond
    generator = torch.Generator().manual_seed(seed)
    extras = {}
    if "pooled" in cond:  # None: the key without a vector, as a T5-only encoder gives it (Chroma)
        width = cond["pooled"]
        extras["pooled_output"] = None if width is None else torch.randn(1, width, generator=generator)
    if "guidance" in cond:
        extras["guidance"] = cond["guidance"]
    tokens = tokens or cond["tokens"]
    if "prompt_share" in cond:  # ComfyUI's encoders give 1 for the prompt's tokens, 0 for the padding after them
        extras["attention_mask"] = (torch.arange(tokens) < max(1, round(tokens * cond["prompt_share"]))).long()[None]
    return [[torch.randn(1, tokens, cond["width"], generator=generator), extras]]


def empty_latent(family: str, width: int, height: int, frames: int = 1, batch: int = 1):
    """Zeros of the family's latent shape: (batch, channels, height/s, width/s), with a time axis for the video-VAE
    families: (frames - 1) / t + 1 latent frames for a video family (t = 4 for Wan, 8 for LTX-Video), as ComfyUI's
    latent nodes make, and one for an image family (Qwen-Image: what ComfyUI's fix_empty_latent_channels makes of an
    empty image latent). LTX-2's is the video's and the audio's packed as LTXV Concat AV Latent packs them (the audio's
    length as LTXV Empty Latent Audio makes it for those frames)."""
    latent = FAMILIES[family].latent
    s = latent["spatial"]
    if not latent["frames"]:
        return torch.zeros(batch, latent["channels"], height // s, width // s)
    time = (frames - 1) // latent.get("temporal", 4) + 1 if latent["video"] else 1
    video = torch.zeros(batch, latent["channels"], time, height // s, width // s)
    audio = latent.get("audio")
    if audio is None:
        return video
    import comfy.nested_tensor
    length = math.ceil(frames / audio["frame_rate"] * audio["per_second"])
    return comfy.nested_tensor.NestedTensor((video, torch.zeros(batch, audio["channels"], length, audio["bins"])))


def flat_latent(latent) -> torch.Tensor:
    """A sampled latent or a model call's output as one tensor for fidelity checks: LTX-2's NestedTensor or list
    (video, audio) flattened and joined, any other tensor as it is."""
    parts = list(latent) if isinstance(latent, (list, tuple)) else latent_parts(latent)
    return torch.cat([t.flatten() for t in parts]) if len(parts) > 1 else parts[0]
