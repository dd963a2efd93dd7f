"""The main job: a real headless ComfyUI with Overdrive on loopback, the example workflow queued over the HTTP API,
eager vs Overdrive timings and how far Overdrive's image is from eager's at the same seed (PSNR) printed, and
Overdrive's image saved.

  python scripts/run_main.py                           # built-in SD1.5 checkpoint (generated, fixed seed)
  python scripts/run_main.py --arch flux               # or any DiT family of builtin_models/dit.py, sd15, sdxl
  python scripts/run_main.py --checkpoint my.safetensors --arch sdxl

Without a GPU it runs small (256², 8 steps; 5 frames for video) so it finishes in minutes; --size/--steps override.
The DiT families run on their built-in diffusion model and VAE with Built-in Conditioning (random text-encoder
output): with --checkpoint, your diffusion-model file replaces the built-in one.
"""
import argparse
import math
import pathlib
import shutil
import sys
import time

import numpy as np
import torch
from PIL import Image

from overdrive.builtin_models import ensure_checkpoint
from overdrive.harness import ComfyClient, ComfyServer
from overdrive.harness.workflows import (BUILTIN_DIT_NAMES, DIT_FAMILIES, builtin_dit_files, dit_workflow, load_workflow,
                                        model_paths_config, set_inputs, set_latent_size, without_overdrive)

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKFLOW = {"sd15": "compile_sd15_api.json", "sdxl": "compile_sdxl_api.json", "flux": "compile_flux_api.json",
            "qwen_image": "compile_qwen_image_api.json", "wan22": "compile_wan22_api.json",
            "ltxv": "compile_ltxv_api.json"}


# Overdrive's timed run takes eager's seed, so their images can be compared; the runs between take other seeds, so
# that ComfyUI runs them instead of serving its cache of an identical prompt.
SEEDS = {"eager": 42, "overdrive, first run (compiles)": 43, "overdrive": 42, "eager again": 44}


def psnr(a: pathlib.Path, b: pathlib.Path) -> float:
    """Peak signal-to-noise ratio of two 8-bit images (a video's first frame), in dB; inf where they are equal."""
    x, y = (np.asarray(Image.open(p).convert("RGB"), dtype=np.float64) for p in (a, b))
    mse = float(((x - y) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def main():
    parser = argparse.ArgumentParser(description="Run the example Overdrive workflow headless and time it against eager.")
    parser.add_argument("--arch", default="sd15", choices=["sd15", "sdxl", *DIT_FAMILIES])
    parser.add_argument("--checkpoint", help="your own checkpoint (SD) or diffusion-model file (DiT families)")
    parser.add_argument("--workflow", help="API-format workflow (file or name in workflows/); default: the arch's")
    parser.add_argument("--size", type=int, help="image width and height (default: the workflow's on GPU, 256 on CPU)")
    parser.add_argument("--steps", type=int, help="sampling steps (default: the workflow's on GPU, 8 on CPU)")
    parser.add_argument("--out", default=str(REPO / "out"), help="where the server's folders and the images go")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    dit = args.arch in DIT_FAMILIES
    workflow = load_workflow(args.workflow) if args.workflow else (
        load_workflow(WORKFLOW[args.arch]) if args.arch in WORKFLOW else dit_workflow(args.arch))
    if args.checkpoint and not pathlib.Path(args.checkpoint).is_file():
        sys.exit(f"--checkpoint {args.checkpoint}: no such file")
    size = "full" if gpu else "tiny"
    print(f"Using the built-in {args.arch} model{' (your file for the diffusion model)' if args.checkpoint else ''}: "
          "fixed-seed random weights, so images look like noise; timings are real.")
    if dit:
        files = builtin_dit_files([args.arch], size)
        if args.checkpoint:
            files["diffusion_models"] = {BUILTIN_DIT_NAMES[args.arch][0]: pathlib.Path(args.checkpoint)}
        checkpoints = {}
    else:
        name = next(n for n in workflow.values() if n["class_type"] == "CheckpointLoaderSimple")["inputs"]["ckpt_name"]
        checkpoints = {name: pathlib.Path(args.checkpoint) if args.checkpoint else ensure_checkpoint(args.arch, size)}
        files = {}
    if args.size or not gpu:
        set_latent_size(workflow, args.size or 256, args.size or 256, frames=None if gpu else 5)
    if args.steps or not gpu:
        set_inputs(workflow, "KSampler", steps=args.steps or 8)

    workdir = pathlib.Path(args.out)
    config = model_paths_config(workdir, checkpoints, files)
    with ComfyServer(workdir, extra_args=["--extra-model-paths-config", str(config)]) as server:
        client = ComfyClient(server.url)
        timings, images = {}, {}
        for label, prompt in (("eager", without_overdrive(workflow)), ("overdrive, first run (compiles)", workflow),
                              ("overdrive", workflow), ("eager again", without_overdrive(workflow))):
            set_inputs(prompt, "SaveImage", filename_prefix=f"overdrive-main-{label.split(',')[0].replace(' ', '-')}")
            set_inputs(prompt, "KSampler", seed=SEEDS[label])
            start = time.perf_counter()
            entry = client.run(prompt, timeout=3600)
            timings[label] = time.perf_counter() - start
            images[label] = client.output_files(entry, server.output_dir)[0]
            print(f"{label:34s} {timings[label]:8.2f} s   {images[label]}")
        saved = workdir / "overdrive-main.png"
        shutil.copy(images["overdrive"], saved)
    eager = min(timings["eager"], timings["eager again"])
    print(f"\nOverdrive {eager / timings['overdrive']:.2f}x eager per prompt (whole prompt: sampling + VAE decode + save; "
          f"eager the faster of its two runs); Overdrive's image against eager's at the same seed: PSNR "
          f"{psnr(images['overdrive'], images['eager']):.1f} dB\nOverdrive's image: {saved}\nComfyUI log: "
          f"{server.log_path}")
    if not gpu:
        print("On the CPU, compiling brings no speed: Overdrive's kernels and CUDA graphs are for NVIDIA GPUs. This run "
              "checks that the workflow runs end to end.")


if __name__ == "__main__":
    main()
