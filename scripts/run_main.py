"""The main job: a real headless ComfyUI with Overdrive on loopback, the example workflow queued over the HTTP API,
eager vs Overdrive timings and how far Overdrive's image is from eager's at the same seed (PSNR, SSIM) printed, and
eager's and Overdrive's images saved side by side.

  python scripts/run_main.py                           # the reference model with learned weights (draws a scene)
  python scripts/run_main.py --prompt "small blue square dotted top-left on-light"
  python scripts/run_main.py --arch flux               # or any DiT family of builtin_models/dit.py, sd15, sdxl
  python scripts/run_main.py --checkpoint my.safetensors --arch sdxl

"scenes" (the default) runs the reference model with learned weights (builtin_models/learned.py: a WAN21 diffusion
model and a Wan 2.1 VAE trained on procedural scenes) through Compile Model and the step cache at 128², on any
machine; "scenes_sd35" the other one (an SD3 MMDiT and SD3's tiny autoencoder). The other built-in models have
fixed-seed random weights: their images are noise, their timings real.
Without a GPU they run small (256², 8 steps; 5 frames for video) so they finish in minutes; --size/--steps override.
The DiT families run on their built-in diffusion model and VAE with Built-in Conditioning (random text-encoder
output): with --checkpoint, your diffusion-model file replaces the built-in one.
"""
import argparse
import math
import pathlib
import shutil
import sys
import time

import torch
from PIL import Image, ImageDraw

from overdrive.builtin_models import ensure_checkpoint, learned
from overdrive.harness import ComfyClient, ComfyServer
from overdrive.harness.image_metrics import load_image, psnr, ssim
from overdrive.harness.workflows import (BUILTIN_DIT_NAMES, DIT_FAMILIES, builtin_dit_files, dit_workflow, load_workflow,
                                        model_paths_config, set_inputs, set_latent_size, without_overdrive)

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKFLOW = {"sd15": "compile_sd15_api.json", "sdxl": "compile_sdxl_api.json", "flux": "compile_flux_api.json",
            "qwen_image": "compile_qwen_image_api.json", "wan22": "compile_wan22_api.json",
            "ltxv": "compile_ltxv_api.json", "scenes": "compile_stepcache_scenes_api.json",
            "scenes_sd35": "compile_stepcache_scenes_sd35_api.json"}
SCENES = {"scenes": "wan22_14b", "scenes_sd35": "sd35"}  # the reference models with learned weights, by --arch


# Overdrive's timed run takes eager's seed, so their images can be compared; the runs between take other seeds, so
# that ComfyUI runs them instead of serving its cache of an identical prompt.
SEEDS = {"eager": 42, "overdrive, first run (compiles)": 43, "overdrive": 42, "eager again": 44}


def side_by_side(eager: pathlib.Path, overdrive: pathlib.Path, caption: str, out: pathlib.Path) -> None:
    """Eager's image (a video's first frame) left, Overdrive's right, at least 256 pixels high, the caption below."""
    left, right = (Image.open(p).convert("RGB") for p in (eager, overdrive))
    scale = max(1, -(-256 // left.height))  # whole pixels: a small image stays sharp
    left, right = (image.resize((image.width * scale, image.height * scale), Image.NEAREST) for image in (left, right))
    text = ImageDraw.Draw(Image.new("RGB", (1, 1))).multiline_textbbox((0, 0), caption)
    picture = Image.new("RGB", (max(left.width + right.width, text[2] + 8), left.height + text[3] + 8), "white")
    picture.paste(left, (0, 0))
    picture.paste(right, (left.width, 0))
    ImageDraw.Draw(picture).multiline_text((4, left.height + 4), caption, fill="black")
    picture.save(out)


def main():
    parser = argparse.ArgumentParser(description="Run the example Overdrive workflow headless and time it against eager.")
    parser.add_argument("--arch", default="scenes", choices=[*SCENES, "sd15", "sdxl", *DIT_FAMILIES])
    parser.add_argument("--prompt", help="scenes: the scene to draw (default: the workflow's)")
    parser.add_argument("--checkpoint", help="your own checkpoint (SD) or diffusion-model file (DiT families)")
    parser.add_argument("--workflow", help="API-format workflow (file or name in workflows/); default: the arch's")
    parser.add_argument("--size", type=int, help="image width and height (default: the workflow's on GPU, 256 on CPU)")
    parser.add_argument("--steps", type=int, help="sampling steps (default: the workflow's on GPU, 8 on CPU)")
    parser.add_argument("--out", default=str(REPO / "out"), help="where the server's folders and the images go")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    scenes = args.arch in SCENES
    dit = args.arch in DIT_FAMILIES or scenes
    workflow = load_workflow(args.workflow) if args.workflow else (
        load_workflow(WORKFLOW[args.arch]) if args.arch in WORKFLOW else dit_workflow(args.arch))
    if args.checkpoint and not pathlib.Path(args.checkpoint).is_file():
        sys.exit(f"--checkpoint {args.checkpoint}: no such file")
    size = "full" if gpu else "tiny"
    if scenes:
        print("Using the reference model with learned weights: it draws the prompt's scene.")
        files, checkpoints = learned.files([SCENES[args.arch]]), {}
        if args.checkpoint:
            files["diffusion_models"] = {learned.MODELS[SCENES[args.arch]].model_name: pathlib.Path(args.checkpoint)}
        if args.prompt:
            set_inputs(workflow, "OverdriveBuiltinConditioning", prompt=args.prompt)
    elif dit:
        print(f"Using the built-in {args.arch} model{' (your file for the diffusion model)' if args.checkpoint else ''}"
              ": fixed-seed random weights, so images look like noise; timings are real.")
        files = builtin_dit_files([args.arch], size)
        if args.checkpoint:
            files["diffusion_models"] = {BUILTIN_DIT_NAMES[args.arch][0]: pathlib.Path(args.checkpoint)}
        checkpoints = {}
    else:
        print(f"Using the built-in {args.arch} model: fixed-seed random weights, so images look like noise; timings "
              "are real.")
        name = next(n for n in workflow.values() if n["class_type"] == "CheckpointLoaderSimple")["inputs"]["ckpt_name"]
        checkpoints = {name: pathlib.Path(args.checkpoint) if args.checkpoint else ensure_checkpoint(args.arch, size)}
        files = {}
    small = not gpu and not scenes  # the reference model is small enough for the CPU at its own size
    if args.size or small:
        set_latent_size(workflow, args.size or 256, args.size or 256, frames=None if gpu else 5)
    if args.steps or small:
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
    eager = min(timings["eager"], timings["eager again"])
    pictures = [load_image(images[label]) for label in ("overdrive", "eager")]
    summary = (f"Overdrive {eager / timings['overdrive']:.2f}x eager per prompt; against eager's image at the same "
               f"seed: PSNR {psnr(*pictures):.1f} dB, SSIM {ssim(*pictures):.3f}")
    saved = workdir / "overdrive-main.png"
    side_by_side(images["eager"], images["overdrive"], f"eager | Overdrive\n{summary}", saved)
    print(f"\n{summary} (whole prompt: sampling + VAE decode + save; eager the faster of its two runs)\n"
          f"Eager's image and Overdrive's, side by side: {saved}\nComfyUI log: {server.log_path}")
    if not gpu:
        print("On the CPU, compiling brings little speed: Overdrive's kernels and CUDA graphs are for NVIDIA GPUs (what "
              "the step cache saves, it saves anywhere). This run checks that the workflow runs end to end.")


if __name__ == "__main__":
    main()
