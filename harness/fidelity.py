"""The fidelity benchmark's parts (bench/bench_fidelity.py and tests/test_learned_models.py): the reference model
with learned weights loaded by ComfyUI's own loaders and sampled by its KSampler path, the accelerator variants as
chains of nodes, and each variant's PSNR, SSIM and latent error against eager's image at the same prompt and seed."""
import re
import statistics
import time

import torch

from .executor import captured_log

# Each variant: the nodes applied to the loaded model, in order (node id, inputs beyond its defaults).
COMPILE = ("OverdriveCompileModel", {})
# The reference model's layers are too small to pass Quantize Model's compute-density and speed tests (a full-size
# model's pass them): every layer its error threshold allows is quantized, so that the table shows each format's effect.
EVERY_LAYER = {"compute_density_threshold": 0.0, "min_speedup": 0.0}
VARIANTS = {
    "eager": [],
    "compile": [COMPILE],
    "int8": [("OverdriveQuantizeModel", {"format": "int8", **EVERY_LAYER}), COMPILE],
    "fp8": [("OverdriveQuantizeModel", {"format": "fp8_e4m3", **EVERY_LAYER}), COMPILE],
    "4bit": [("OverdriveQuantizeModel", {"bits": 4, "format": "int4_fp8", **EVERY_LAYER}), COMPILE],
    "8bit-attention": [("OverdriveQuantizeModel", {"format": "fp8_e4m3", "attention": "8bit", **EVERY_LAYER}),
                       COMPILE],
    "stepcache-default": [COMPILE, ("OverdriveDeepCache", {})],
    "stepcache3": [COMPILE, ("OverdriveDeepCache", {"mode": "fixed", "cache_interval": 3})],
    "stepcache2": [COMPILE, ("OverdriveDeepCache", {"mode": "fixed", "cache_interval": 2})],
    "stepcache4-window0.1-0.95": [COMPILE, ("OverdriveDeepCache", {"mode": "fixed", "cache_interval": 4,
                                                                   "start_percent": 0.1,
                                                                   "end_percent": 0.95})],
    "stepcache-adaptive0.05": [COMPILE, ("OverdriveDeepCache", {"mode": "adaptive", "threshold": 0.05})],
    "stepcache-adaptive0.1": [COMPILE, ("OverdriveDeepCache", {"mode": "adaptive", "threshold": 0.1})],
    "stepcache-adaptive0.15": [COMPILE, ("OverdriveDeepCache", {"mode": "adaptive", "threshold": 0.15})],
    "stepcache-adaptive0.2": [COMPILE, ("OverdriveDeepCache", {"mode": "adaptive", "threshold": 0.2})],
    "stepcache-calibrated0.05": [COMPILE, ("OverdriveDeepCache", {"mode": "calibrated", "threshold": 0.05})],
    "stepcache-calibrated0.1": [COMPILE, ("OverdriveDeepCache", {"mode": "calibrated", "threshold": 0.1})],
    "stepcache-calibrated0.15": [COMPILE, ("OverdriveDeepCache", {"mode": "calibrated", "threshold": 0.15})],
    "stepcache-calibrated0.2": [COMPILE, ("OverdriveDeepCache", {"mode": "calibrated", "threshold": 0.2})],
    # Sparse Video Attention: run on clips (bench_fidelity.py --frames), where the mask skips work
    "sparse-video": [COMPILE, ("OverdriveSparseVideoAttention", {})],
    "sparse-video-dense0": [COMPILE, ("OverdriveSparseVideoAttention", {"dense_steps": 0.0})],
    "sparse-video-window2": [COMPILE, ("OverdriveSparseVideoAttention", {"window": 2})],
    "sparse-video-dense0.5": [COMPILE, ("OverdriveSparseVideoAttention", {"dense_steps": 0.5})],
    "sparse-video-dense0.75": [COMPILE, ("OverdriveSparseVideoAttention", {"dense_steps": 0.75})],
    "easycache": [("EasyCache", {})],
    "lazycache": [("LazyCache", {})],
}


def scene_prompts(count: int, seed: int, video: bool = False) -> list:
    """(prompt, seed) pairs: random still scenes (moving ones with `video`), each sampled at its own seed."""
    from overdrive.builtin_models import scenes
    generator = torch.Generator().manual_seed(seed)
    return [(scenes.random_scene(generator, video=video).prompt(video=video), seed + i) for i in range(count)]


def apply_node(node_id: str, model, inputs: dict):
    """A node applied as ComfyUI would: Overdrive's with their declared defaults, ComfyUI's by its V3 class."""
    if node_id.startswith("Overdrive"):
        from .inprocess import run_node
        return run_node(node_id, model=model, **inputs)
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode
    cls = {"EasyCache": EasyCacheNode, "LazyCache": LazyCacheNode}[node_id]
    return cls.execute(model, **{"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95,
                                 "verbose": False, **inputs})[0]


class Scenes:
    """A learned model (builtin_models.learned.MODELS), its VAE and the sampling of one prompt and seed."""

    def __init__(self, steps: int, cfg: float, side: int, name: str = "wan22_14b", frames: int = 1):
        import comfy.sd
        import comfy.utils

        from overdrive.builtin_models import learned
        self.learned = learned.MODELS[name]
        self.model = comfy.sd.load_diffusion_model(str(learned.FOLDER / self.learned.dit_file))
        self.vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(learned.FOLDER / self.learned.vae_file)))
        self.steps, self.cfg, self.side, self.frames = steps, cfg, side, frames

    def empty_latent(self) -> torch.Tensor:
        from overdrive.builtin_models.dit import empty_latent
        return empty_latent(self.learned.family, self.side, self.side, self.frames)

    def conditioning(self, prompt: str):
        from overdrive.builtin_models import learned
        return learned.conditioning(self.learned.family, prompt), learned.conditioning(self.learned.family, "")

    def sample(self, patcher, prompt: str, seed: int):
        """(latent, image (1, h, w, 3) in [0, 1]: a clip's frames one under the other, seconds)."""
        import comfy.model_management
        import comfy.sample
        positive, negative = self.conditioning(prompt)
        latent = self.empty_latent()
        noise = comfy.sample.prepare_noise(latent, seed)
        synchronize()
        start = time.perf_counter()
        out = comfy.sample.sample(patcher, noise, self.steps, self.cfg, "euler", "simple", positive, negative, latent,
                                  seed=seed, disable_pbar=True)
        image = self.vae.decode(out)
        if image.ndim == 5:  # a video VAE's (batch, frames, h, w, 3): the first frame of an image, a clip's all
            image = image[:, 0] if self.frames == 1 else image.flatten(1, 2)
        image = image.float().cpu()
        synchronize()
        return out.float().cpu(), image, time.perf_counter() - start


def accelerated(scenes_model, chain: list, prompt: str):
    """The learned model with `chain`'s nodes applied; Quantize Model calibrates on `prompt` at the model's size, as a
    workflow wires it."""
    patcher = scenes_model.model
    positive, negative = scenes_model.conditioning(prompt)
    for node_id, inputs in chain:
        if node_id == "OverdriveQuantizeModel":
            inputs = {**inputs, "positive": positive, "negative": negative,
                      "latent": {"samples": scenes_model.empty_latent()}}
        patcher = apply_node(node_id, patcher, inputs)
    return patcher


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_cache_counts(patcher) -> dict:
    """Overdrive's step cache: the full and the reused steps of the image just sampled (the speed it can give, whatever
    the machine); {} for other variants."""
    cache = getattr(patcher.object_patches.get("diffusion_model.forward"), "step_cache", None)
    stats = cache.last_stats if cache is not None else None
    return {"steps_full_reused": [stats.full_steps, stats.shallow_steps]} if stats else {}


PEER_SKIPS = re.compile(r"(?:EasyCache|LazyCache) - skipped (\d+)/(\d+) steps")


def peer_step_counts(lines) -> dict:
    """ComfyUI's EasyCache and LazyCache log the steps they skipped at the end of a sampling run: as full / reused
    steps, beside Overdrive's step cache's counts; {} where neither ran."""
    found = [match for match in map(PEER_SKIPS.search, lines) if match]
    if not found:
        return {}
    skipped, total = map(int, found[-1].groups())
    return {"steps_full_reused": [total - skipped, skipped]}


@torch.inference_mode()  # as ComfyUI runs its nodes
def measure(scenes_model, name: str, chain: list, prompts: list, eager: dict) -> dict:
    """The variant's row: its images against `eager`'s ({(prompt, seed): (latent, image)}; None: this is eager's),
    each prompt's outputs under "outputs"."""
    from overdrive.harness.image_metrics import psnr, ssim
    start = time.perf_counter()
    patcher = accelerated(scenes_model, chain, prompts[0][0])
    prepare_s = time.perf_counter() - start
    scenes_model.sample(patcher, *prompts[0])  # warm-up: compiles, calibrates attention
    rows = []
    for prompt, seed in prompts:
        with captured_log() as log:
            latent, image, seconds = scenes_model.sample(patcher, prompt, seed)
        rows.append({"prompt": prompt, "seed": seed, "s": round(seconds, 4),
                     **(step_cache_counts(patcher) or peer_step_counts(log.lines))})
        rows[-1]["outputs"] = (latent, image)  # for eager's comparisons and the picture; not written out
        if eager is not None:
            reference_latent, reference_image = eager[(prompt, seed)]
            rows[-1].update(psnr=round(psnr(image, reference_image), 2), ssim=round(ssim(image, reference_image), 4),
                            latent_rel_err=round(float((latent - reference_latent).norm()
                                                       / reference_latent.norm()), 5))
    summary = {"variant": name, "nodes": [[n, i] for n, i in chain], "prepare_s": round(prepare_s, 2),
               "s_per_image": round(statistics.median(r["s"] for r in rows), 4)}
    counts = [r["steps_full_reused"] for r in rows if "steps_full_reused" in r]
    if counts:  # over every prompt: the share of steps the cache reused
        summary["steps_full_reused"] = [sum(c[0] for c in counts), sum(c[1] for c in counts)]
    if eager is not None:
        finite = [r["psnr"] for r in rows if r["psnr"] != float("inf")]
        summary.update(psnr_mean=round(statistics.mean(finite), 2) if finite else float("inf"),
                       psnr_median=round(statistics.median(r["psnr"] for r in rows), 2),
                       psnr_min=round(min(finite), 2) if finite else float("inf"),
                       ssim_mean=round(statistics.mean(r["ssim"] for r in rows), 4),
                       latent_rel_err_mean=round(statistics.mean(r["latent_rel_err"] for r in rows), 5))
    summary["per_prompt"] = rows
    return summary
