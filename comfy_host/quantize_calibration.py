"""QuantizeModel's calibration pass: a few real sampling steps on the user's prompt and latent, or on empty (zero)
conditioning at the model's natural resolution when those are not connected."""
import dataclasses
import logging

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sample
import comfy.sampler_helpers
import comfy.utils

from .latents import latent_parts  # the first part is the image or video the calibration is keyed and described by
from ..quantization import resolution_bucket

log = logging.getLogger("overdrive")

SEED, CFG, SAMPLER, SCHEDULER = 0, 7.0, "euler", "normal"
NATURAL_PIXELS = {"SD15": 512, "SDXL": 1024, "SDXL_Playground_2_5": 1024}  # latent format class -> trained size
POOLED_SIZE = {"SDXL": 1280, "SDXLRefiner": 1280}  # model class -> size of the pooled CLIP output it conditions on
MAX_STEPS = 50
DEFAULT_STEPS = 3  # three noise levels of the schedule: each layer is measured on high, middle and low-noise inputs
ROOM_KEY = "overdrive_calibration_room"
# Kept free beside ComfyUI's activations estimate while calibrating and measuring: the recording hooks' temporaries,
# the attention chooser's trial calls, and each layer measured at its largest call (input, fp32 output, its weight in
# three precisions)
RECORDING_ROOM = 2 * 2**30


def zero_conditioning(conditioning):
    """Zeros of the same shapes (what ComfyUI's ConditioningZeroOut makes)."""
    out = []
    for cond, extra in conditioning:
        extra = dict(extra)
        if "pooled_output" in extra:
            extra["pooled_output"] = torch.zeros_like(extra["pooled_output"])
        out.append([torch.zeros_like(cond), extra])
    return out


def empty_conditioning(model, width: int, height: int):
    """Zero conditioning of the shapes `model` takes: [[cond (1, 77, context_dim), {pooled_output, sizes}]]."""
    base = model.model
    name = type(base).__name__
    context_dim = base.model_config.unet_config.get("context_dim")
    needs_pooled = bool(base.model_config.unet_config.get("adm_in_channels"))
    if context_dim is None or (needs_pooled and name not in POOLED_SIZE):
        raise ValueError(f"Quantize Model cannot build empty conditioning for a {name} model. Connect the positive "
                         f"and negative inputs (your prompt's CONDITIONING) and a latent.")
    extra = {}
    if needs_pooled:
        extra = dict(pooled_output=torch.zeros(1, POOLED_SIZE[name]), width=width, height=height, crop_w=0, crop_h=0,
                     target_width=width, target_height=height)
    return [[torch.zeros(1, 77, context_dim), extra]]


def natural_latent(model) -> torch.Tensor:
    """A zero latent at the size the model was trained at (SD1.5 512² -> 64², SDXL 1024² -> 128²), batch 1."""
    latent_format = model.model.latent_format
    pixels = NATURAL_PIXELS.get(type(latent_format).__name__)
    if pixels is None:
        raise ValueError(f"Quantize Model does not know the natural resolution of {type(model.model).__name__} "
                         f"models. Connect the latent input (e.g. your Empty Latent Image).")
    channels = getattr(latent_format, "latent_channels", 4)
    return torch.zeros(1, channels, pixels // 8, pixels // 8)


def _check_conditioning(name, value):
    if value is None:
        return
    if not isinstance(value, list) or not value or not all(
            isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], torch.Tensor) for c in value):
        raise ValueError(f"Quantize Model: {name} is not a CONDITIONING; connect a CLIP Text Encode output.")


@dataclasses.dataclass
class CalibrationRun:
    """What the calibration samples with; called with the ModelPatcher to run it (see `plan_quantization`)."""

    positive: list
    negative: list
    latent: torch.Tensor  # or a nested latent (latent_parts)
    steps: int
    empty_conditioning: bool
    natural_size: bool

    @classmethod
    def build(cls, model, positive, negative, latent, steps) -> "CalibrationRun":
        """Validated settings; raises ValueError naming the input and the fix."""
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"Quantize Model: calibration_steps={steps!r}; use a whole number from 1 to {MAX_STEPS} "
                             f"(2-3 are enough: the error is measured per layer on the inputs those steps produce).")
        _check_conditioning("positive", positive)
        _check_conditioning("negative", negative)
        parts = latent_parts(latent.get("samples")) if isinstance(latent, dict) else [None]
        if latent is not None and not (all(isinstance(part, torch.Tensor) for part in parts)
                                       and parts[0].dim() in (4, 5)):
            raise ValueError("Quantize Model: latent is not a LATENT of images (batch, channels, height, width) or "
                             "videos (batch, channels, frames, height, width), alone or with audio (LTX-2); connect an "
                             "Empty Latent Image, an empty video latent, LTXV Concat AV Latent or a VAE Encode output.")
        samples = natural_latent(model) if latent is None else latent["samples"]
        empty = positive is None and negative is None
        if empty:
            image = latent_parts(samples)[0]
            positive = empty_conditioning(model, image.shape[-1] * 8, image.shape[-2] * 8)
        positive = positive if positive is not None else zero_conditioning(negative)
        negative = negative if negative is not None else zero_conditioning(positive)
        return cls(positive, negative, samples, steps, empty, latent is None)

    def cache_context(self) -> str:
        """Part of the decision cache key: resolution bucket, (video) frames, the other parts' shapes (audio), steps
        and whether a prompt was used."""
        image, *others = latent_parts(self.latent)
        shape = image.shape
        frames = f"-{shape[2]}f" if image.dim() == 5 else ""
        others = "".join(f"+{'x'.join(map(str, part.shape[1:]))}" for part in others)
        return (f"{resolution_bucket((shape[0], shape[-2], shape[-1]))}{frames}{others}-{self.steps}steps-"
                f"{'empty' if self.empty_conditioning else 'prompt'}")

    def describe(self) -> str:
        image, *others = latent_parts(self.latent)
        b, h, w = image.shape[0], image.shape[-2], image.shape[-1]
        frames = f"{image.shape[2]} latent frames, " if image.dim() == 5 else ""
        size = f"{frames}{w}x{h} latent" + (" (the model's natural size)" if self.natural_size else "")
        size += "".join(f" with a {tuple(part.shape[1:])} latent" for part in others)
        prompt = "empty (zero) conditioning" if self.empty_conditioning else "your conditioning"
        return f"{self.steps} {SAMPLER} step(s), batch {b} at {size}, on {prompt}"

    def __call__(self, patcher):
        log.info("Overdrive: calibrating quantization: %s", self.describe())
        if self.empty_conditioning or self.natural_size:
            log.info("Overdrive: connect Quantize Model's positive/negative/latent inputs to calibrate on your prompt "
                     "and resolution.")
        bar = comfy.utils.ProgressBar(self.steps)
        noise = comfy.sample.prepare_noise(self.latent, SEED)
        with torch.inference_mode():  # as ComfyUI samples
            comfy.sample.sample(patcher, noise, self.steps, CFG, SAMPLER, SCHEDULER, self.positive, self.negative,
                                self.latent, seed=SEED, disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED,
                                callback=lambda step, *_: bar.update_absolute(step + 1, self.steps))


def leave_room(executor, model, noise_shape, conds, *args, **kwargs):
    """A PREPARE_SAMPLING wrapper on the calibration clone: after ComfyUI's classic load (dynamic VRAM off), room for
    the sampling's activations (ComfyUI's estimate) and RECORDING_ROOM is made on the card, from other models first,
    then by unloading part of this one (never all of it: it is about to run). That loader fills a short card with the
    float model up to its own estimate, and the recording beside it ran out of memory in the first step
    (bench/experiments/loras-on-quantized-layers.md). Dynamic VRAM frees its weights on demand: nothing to do."""
    prepared = executor(model, noise_shape, conds, *args, **kwargs)
    device = model.load_device
    if device.type != "cuda" or model.is_dynamic():
        return prepared
    mm = comfy.model_management
    required, _ = comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)
    wanted = required + RECORDING_ROOM + mm.extra_reserved_memory()
    mm.free_memory(wanted, device, keep_loaded=[loaded for loaded in mm.current_loaded_models if loaded.model is model])
    if (short := wanted - mm.get_free_memory(device)) > 0:
        model.partially_unload(model.offload_device, short)
    return prepared


def with_room_to_calibrate(patcher) -> None:
    patcher.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, ROOM_KEY)
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, ROOM_KEY, leave_room)
