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
import threading
from typing import Dict, Optional

import torch

from ..comfy_host.latents import latent_parts
from ..core.storage import cache_dir
from ..families import registered
from ..families.family import BuiltinModel
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


# The built-in models, by name, from the families' own modules (families/<family>.py: its BuiltinModel-s).
FAMILIES: Dict[str, BuiltinModel] = {model.name: model for family in registered() for model in family.builtin_models}

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


@contextlib.contextmanager
def quiet_build():
    """layers_with_weights, with ComfyUI's prints while a model is laid out dropped. The redirect inside its lock:
    stdout is process-wide, and two threads' redirects ending out of order (the iteration soak writes its second model
    beside its prompts) left it pointing at one of them for good, so the soak's own lines never reached its log."""
    with layers_with_weights(), contextlib.redirect_stdout(io.StringIO()):
        yield


# The switch below is process-wide: one build at a time, or a thread writing a file beside another's build (the
# iteration soak's second model) has it switched back mid-build and lays out a model without its weights.
_LAYERS_WITH_WEIGHTS = threading.RLock()


@contextlib.contextmanager
def layers_with_weights():
    """ComfyUI's layers built with their weights: under dynamic VRAM its layers leave them unset until a state dict
    loads (comfy.ops), and a built-in model is laid out and initialised from its modules' own tensors."""
    import comfy.memory_management
    with _LAYERS_WITH_WEIGHTS:
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
    with torch.device(device), quiet_build():
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
    with torch.device("meta"), quiet_build():
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
