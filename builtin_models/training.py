"""Trains a reference model with learned weights (builtin_models/learned.py) on procedural scenes
(builtin_models/scenes.py): first its VAE (or it reads a trained one), then the diffusion model on that VAE's latents,
the prompt one fixed vector per word. The same seed and steps give the same weights on the same machine and software.

  python -m overdrive.builtin_models.training --family wan22_14b|sd35 --out DIR [--seed 0] [--vae-from FILE]
                                              [--vae-steps N] [--dit-steps N]

Both files are written as ComfyUI's loaders read them (Load VAE, Load Diffusion Model), in fp16, with the loss curves
and timings in DIR/training_<family>.json. Written again every --save-every steps, so a run cut short keeps what it
learned. The models run through ComfyUI's own classes: ComfyUI must be importable (scripts/install.sh, or
COMFYUI_PATH).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import time

import torch
import torch.nn.functional as F

from ..core.storage import atomic_file
from . import scenes
from .dit import TINY_VAE, VAES, build_model
from .learned import MODELS, SIDE, LearnedModel, conditioning

FRAMES = 9  # frames of a training clip (two latent frames after the first)
CFG_DROP = 0.1  # share of training prompts replaced by the empty prompt (zeros), for classifier-free guidance
NOISE_IN_LATENT = 0.05  # the decoder learns to read slightly wrong latents, as a sampler leaves them
OUTPUT_HEADS = {"wan22_14b": "head.head", "sd35": "final_layer.linear"}  # the diffusion model's last layer


def report_file(m: LearnedModel) -> str:
    return f"training_{m.family}.json"


def latent_format(m: LearnedModel):
    import comfy.latent_formats
    return comfy.latent_formats.Wan21() if m.vae == "wan21" else comfy.latent_formats.SD3()


def prompt_conditioning(m: LearnedModel, prompts: list) -> tuple:
    """(context (batch, TOKENS, width), pooled vector (batch, width) or None): what Built-in Conditioning gives the
    scenes' prompts (a clip's names its motion); an empty prompt is all zeros (the unconditional input)."""
    conds = [conditioning(m.family, p)[0] for p in prompts]
    context = torch.cat([c[0] for c in conds])
    pooled = torch.cat([c[1]["pooled_output"] for c in conds]) if "pooled_output" in conds[0][1] else None
    return context, pooled


def scene_pool(count: int, video: bool, generator: torch.Generator) -> list:
    """Every still scene (count 0), or `count` random scenes (clips when `video`)."""
    if count == 0 and not video:
        import itertools
        names = [name for name in scenes.ATTRIBUTES if name != "motion"]
        return [scenes.Scene(**dict(zip(names, words)))
                for words in itertools.product(*(scenes.ATTRIBUTES[name] for name in names))]
    return [scenes.random_scene(generator, video=video) for _ in range(count)]


def render_pool(pool: list, frames: int, side: int) -> torch.Tensor:
    """(n, 3, frames, side, side) in fp16: the pixels a VAE encodes."""
    return torch.stack([scenes.render(s, side, frames).reshape(3, frames, side, side) for s in pool]).half()


def trainable(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fan-in initialised (ComfyUI's layers skip initialisation), RMS-norm scales at 1, every parameter trained
    (ComfyUI builds its models for inference: requires_grad off)."""
    from ..harness.inprocess import seeded_init_
    with torch.no_grad():
        seeded_init_(module, seed)
        for name, p in module.named_parameters():
            if name.endswith("gamma"):  # Wan's VAE keeps its norms' scales as (channels, 1, 1[, 1])
                p.fill_(1.0)
    return module.requires_grad_(True)


def build_vae(m: LearnedModel, seed: int, device) -> torch.nn.Module:
    """ComfyUI's Wan 2.1 VAE at its smallest width, or its TAESD with SD3's 16 channels and SD3's latent scale and
    shift, fixed, as ComfyUI's Load VAE gives "taesd3" (the encoder learns latents in the model's space)."""
    with torch.device(device):
        if m.vae == "wan21":
            import comfy.ldm.wan.vae
            _, config = VAES["wan21"]
            return trainable(comfy.ldm.wan.vae.WanVAE(**{**config, **TINY_VAE["wan21"]}), seed)
        import comfy.taesd.taesd
        vae = trainable(comfy.taesd.taesd.TAESD(latent_channels=16), seed)
    fmt = latent_format(m)
    with torch.no_grad():
        vae.vae_scale.fill_(fmt.scale_factor)
        vae.vae_shift.fill_(fmt.shift_factor)
    vae.vae_scale.requires_grad_(False)
    vae.vae_shift.requires_grad_(False)
    return vae


def read_vae(m: LearnedModel, path: str, device) -> torch.nn.Module:
    """A VAE trained before (its file as the trainer wrote it), in float32."""
    from safetensors.torch import load_file
    vae = build_vae(m, 0, device)
    vae.load_state_dict({key: t.float() for key, t in load_file(path).items()})
    return vae


def vae_pixels(m: LearnedModel, pixels: torch.Tensor) -> torch.Tensor:
    """(n, 3, frames, h, w) as the VAE takes them: an image VAE has no time axis."""
    return pixels if m.vae == "wan21" else pixels[:, :, 0]


def build_dit(m: LearnedModel, seed: int, device) -> torch.nn.Module:
    """ComfyUI's model of the family at the learned model's width and depth, fan-in initialised, its output layer at
    zero (it starts by predicting no velocity: the first steps do not fight a random output)."""
    model = build_model(m.family, "full", torch.float32, device, overrides=m.config)
    trainable(model.diffusion_model, seed)
    head = model.diffusion_model.get_submodule(OUTPUT_HEADS[m.family])
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        pos_embed = getattr(model.diffusion_model, "pos_embed", None)
        if pos_embed is not None:  # SD3's fixed 2-D sin-cos table, a buffer its checkpoints carry
            from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed
            grid = int(round(pos_embed.shape[1] ** 0.5))
            table = torch.from_numpy(get_2d_sincos_pos_embed(pos_embed.shape[2], grid))
            pos_embed.copy_(table.reshape(pos_embed.shape))
    return model


def batches(generator: torch.Generator, images: torch.Tensor, clips: torch.Tensor, image_batch: int,
            clip_batch: int, step: int):
    """Image batches on even steps, clip batches on odd ones: (indices, which pool)."""
    pool, size = (images, image_batch) if step % 2 == 0 or len(clips) == 0 else (clips, clip_batch)
    return torch.randint(len(pool), (size,), generator=generator), pool


def latent_moments_loss(latent: torch.Tensor) -> torch.Tensor:
    """How far each channel of the normalised latent is from zero mean and unit spread: keeps the latents in the
    range ComfyUI's Wan 2.1 latent format and the sampler's noise assume."""
    dims = [0, *range(2, latent.ndim)]
    return (latent.mean(dims) ** 2 + (latent.std(dims) - 1) ** 2).mean()


def due(step: int, steps: int, every: int) -> bool:
    """Whether step `step` (from 0) of `steps` is a multiple of `every`, or the last."""
    return (step + 1) % every == 0 or step + 1 == steps


def optimize(optimizer, loss: torch.Tensor, step: int, steps: int, peak_lr: float, warmup: int = 100) -> None:
    """One step at a cosine learning rate after a linear warm-up (at most a quarter of a short run), gradients
    clipped to norm 1."""
    warmup = min(warmup, max(1, steps // 4))
    lr = peak_lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / max(steps, 1), 1.0)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    optimizer.step()


def train_vae(m, vae, images, clips, steps, seed, args, log, save):
    fmt = latent_format(m)
    generator, noise = torch.Generator().manual_seed(seed), torch.Generator(images.device).manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in vae.parameters() if p.requires_grad], lr=args.vae_lr, weight_decay=0.0)
    for step in range(steps):
        indices, pool = batches(generator, images, clips, args.image_batch, args.clip_batch, step)
        pixels = vae_pixels(m, pool[indices.to(pool.device)].float())
        latent = fmt.process_in(vae.encode(pixels))
        noisy = latent + NOISE_IN_LATENT * torch.randn(latent.shape, generator=noise, device=latent.device)
        decoded = vae.decode(fmt.process_out(noisy))
        reconstruction = F.mse_loss(decoded, pixels) + 0.5 * F.l1_loss(decoded, pixels)
        loss = reconstruction + 0.01 * latent_moments_loss(latent)
        optimize(optimizer, loss, step, steps, args.vae_lr)
        log("vae", step, steps, reconstruction=reconstruction.detach(), loss=loss.detach())
        save(step, steps)


@torch.no_grad()
def encode_pool(m, vae, pixels: torch.Tensor, batch: int = 64) -> torch.Tensor:
    fmt = latent_format(m)
    if len(pixels) == 0:  # an image model's empty clip pool
        return pixels.float()
    return torch.cat([fmt.process_in(vae.encode(vae_pixels(m, pixels[i:i + batch].float())))
                      for i in range(0, len(pixels), batch)])


def sigmas(batch: int, shift: float, generator: torch.Generator, device) -> torch.Tensor:
    """Half from the shifted schedule ComfyUI samples WAN21 with (most steps at high noise), half uniform, so the
    low-noise steps that draw the details are trained too."""
    u = torch.rand(batch, generator=generator)
    shifted = shift * u / (1 + (shift - 1) * u)
    return torch.where(torch.rand(batch, generator=generator) < 0.5, shifted, u).clamp(1e-3, 1.0).to(device)


def train_dit(model, image_latents, clip_latents, image_conds, clip_conds, steps, seed, args, log, save):
    """`image_conds`, `clip_conds`: each pool's (context, pooled vector or None)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.Generator(image_latents.device).manual_seed(seed)
    shift = float(model.model_sampling.shift)
    optimizer = torch.optim.AdamW(model.diffusion_model.parameters(), lr=args.dit_lr, weight_decay=0.01)
    for step in range(steps):
        indices, pool = batches(generator, image_latents, clip_latents, args.image_batch, args.clip_batch, step)
        contexts, pooled = image_conds if pool is image_latents else clip_conds
        x0, context = pool[indices.to(pool.device)], contexts[indices].to(pool.device)
        kept = (torch.rand(len(indices), generator=generator) >= CFG_DROP).to(context.device)
        extra = {} if pooled is None else {"y": pooled[indices].to(pool.device) * kept[:, None]}
        context = context * kept[:, None, None]
        sigma = sigmas(len(indices), shift, generator, x0.device)
        epsilon = torch.randn(x0.shape, generator=noise, device=x0.device)
        s = sigma.view(-1, *[1] * (x0.ndim - 1))
        noisy = (1 - s) * x0 + s * epsilon
        denoised = model.apply_model(noisy, sigma, c_crossattn=context, **extra)
        velocity = (noisy - denoised) / s  # ComfyUI's flow models predict eps - x0: denoised = x - sigma * v
        loss = F.mse_loss(velocity, epsilon - x0)
        optimize(optimizer, loss, step, steps, args.dit_lr)
        log("dit", step, steps, loss=loss.detach())
        save(step, steps)


def write_fp16(module: torch.nn.Module, path: pathlib.Path, metadata: dict) -> None:
    from safetensors.torch import save_file
    state = {key: t.detach().to("cpu", torch.float16).contiguous() for key, t in module.state_dict().items()}
    with atomic_file(path) as tmp:
        save_file(state, str(tmp), metadata={key: str(value) for key, value in metadata.items()})


class Recorder:
    """Loss curves (a point every `every` steps, the mean since the last), timings, and the files written. Losses are
    summed on their device and read at each point only: a read every step would make the host wait for the GPU."""

    def __init__(self, path: pathlib.Path, settings: dict, every: int):
        self.path, self.every, self.started = path, every, time.perf_counter()
        self.report = {"settings": settings, "curves": {}, "seconds": {}}
        self.sums = {}

    def log(self, stage: str, step: int, steps: int, **values) -> None:
        sums = self.sums.setdefault(stage, {})
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + value
        if due(step, steps, self.every):
            count = (step % self.every) + 1
            point = {"step": step + 1, **{name: float(total) / count for name, total in sums.items()}}
            self.report["curves"].setdefault(stage, []).append(point)
            self.sums[stage] = {}
            print(f"{stage} {step + 1}/{steps} " + " ".join(f"{k} {v:.5f}" for k, v in point.items() if k != "step")
                  + f" ({time.perf_counter() - self.started:.0f} s)", flush=True)

    def stage_done(self, stage: str, seconds: float) -> None:
        self.report["seconds"][stage] = round(seconds, 1)
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.report, indent=1) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the two model files and training_<family>.json")
    parser.add_argument("--family", default="wan22_14b", choices=list(MODELS), help="which reference model")
    parser.add_argument("--vae-from", help="a VAE file this trainer wrote: read it and train the diffusion model only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", type=int, default=SIDE, help="pixels per side (a multiple of 16)")
    parser.add_argument("--frames", type=int, default=FRAMES, help="frames of a training clip (4k + 1)")
    parser.add_argument("--clips", type=int, default=1024, help="random clips in the training pool (video models)")
    parser.add_argument("--images", type=int, default=0, help="random still scenes in the pool; 0: every one")
    parser.add_argument("--vae-steps", type=int, default=2000)
    parser.add_argument("--dit-steps", type=int, default=6000)
    parser.add_argument("--image-batch", type=int, default=32)
    parser.add_argument("--clip-batch", type=int, default=8)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--dit-lr", type=float, default=5e-4)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode, before CUDA starts
    from ..harness.inprocess import import_comfy
    with training_settings(import_comfy(cpu=args.device == "cpu")):
        return train(args)


@contextlib.contextmanager
def training_settings(comfy):
    """ComfyUI's differentiable paths and torch's deterministic algorithms while training, and everything as it was
    afterwards (the trainer also runs inside a test process)."""
    backends = torch.backends
    saved = (comfy.model_management.in_training, backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32,
             backends.cudnn.deterministic, backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    comfy.model_management.in_training = True  # ComfyUI's differentiable paths (its fused RoPE op has no backward)
    backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = True
    backends.cudnn.deterministic, backends.cudnn.benchmark = True, False  # same seed, same weights
    torch.use_deterministic_algorithms(True, warn_only=True)  # and a warning naming any op that cannot promise it
    try:
        yield
    finally:
        (comfy.model_management.in_training, backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32,
         backends.cudnn.deterministic, backends.cudnn.benchmark) = saved[:5]
        torch.use_deterministic_algorithms(saved[5], warn_only=saved[6])


def train(args) -> dict:
    m = MODELS[args.family]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(config=m.config, vae=m.vae, vae_from=pathlib.Path(args.vae_from).name if args.vae_from else None)
    recorder = Recorder(out / report_file(m), settings, args.log_every)
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    still = scene_pool(args.images, False, generator)
    moving = scene_pool(args.clips, True, generator) if m.video else []
    images = render_pool(still, 1, args.side).to(args.device)
    clips = render_pool(moving, args.frames, args.side).to(args.device) if moving else images[:0]
    recorder.stage_done("render", time.perf_counter() - started)
    metadata = {"overdrive_learned": "scenes", "family": m.family, "seed": args.seed, "side": args.side,
                "tokens": scenes.TOKENS}

    def saver(module, path):
        def save(step, steps):
            if due(step, steps, args.save_every):
                write_fp16(module, path, {**metadata, "steps": step + 1})
                recorder.write()
        return save

    if args.vae_from:
        vae = read_vae(m, args.vae_from, args.device)
    else:
        vae = build_vae(m, args.seed, args.device)
        started = time.perf_counter()
        train_vae(m, vae, images, clips, args.vae_steps, args.seed, args, recorder.log, saver(vae, out / m.vae_file))
        recorder.stage_done("vae", time.perf_counter() - started)

    vae.half().float()  # the DiT learns the latents of the fp16 file, as ComfyUI will encode them
    image_latents, clip_latents = encode_pool(m, vae, images), encode_pool(m, vae, clips)
    del images, clips
    image_conds = prompt_conditioning(m, [s.prompt() for s in still])
    clip_conds = (prompt_conditioning(m, [s.prompt(video=True) for s in moving]) if moving
                  else (image_conds[0][:0], None))
    model = build_dit(m, args.seed, args.device)
    started = time.perf_counter()
    train_dit(model, image_latents, clip_latents, image_conds, clip_conds, args.dit_steps, args.seed, args,
              recorder.log, saver(model.diffusion_model, out / m.dit_file))
    recorder.stage_done("dit", time.perf_counter() - started)
    recorder.report["environment"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
                                      if args.device != "cpu" else "cpu"}
    recorder.write()
    return recorder.report


if __name__ == "__main__":
    main()
