"""The main job: a real headless ComfyUI with Overdrive on loopback, the example workflow queued over the HTTP API,
eager vs Overdrive timings and how far Overdrive's image is from eager's at the same seed (PSNR, SSIM) printed, and
eager's and Overdrive's images saved side by side.

  python scripts/run_main.py                           # the reference model with learned weights (a scene)
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

It runs the code of the clone it lives in, whatever `overdrive` pip installed, and checks its arguments and prompt
before it starts ComfyUI: a bad one is named in one line (exit code 2). Eager and Overdrive are timed --repeats times
each, alternately, after one untimed run each (model load; compile); their medians are compared.
"""
import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def import_this_clone() -> None:
    """Make `overdrive` this clone's package, not the one pip installed (an editable install points at one clone, and
    two clones or a worktree on one machine ran each other's code)."""
    spec = importlib.util.spec_from_file_location("overdrive", REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["overdrive"] = package
    spec.loader.exec_module(package)


import_this_clone()

import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from overdrive.builtin_models import ensure_checkpoint, learned, scenes  # noqa: E402
from overdrive.harness import ComfyClient, ComfyServer  # noqa: E402
from overdrive.harness.client import PromptFailed  # noqa: E402
from overdrive.harness.image_metrics import load_image, psnr, ssim  # noqa: E402
from overdrive.harness.workflows import (BUILTIN_DIT_NAMES, DIT_FAMILIES, builtin_dit_files, dit_workflow,  # noqa: E402
                                        load_workflow, model_paths_config, set_inputs, set_latent_size,
                                        without_overdrive)

WORKFLOW = {"sd15": "compile_sd15_api.json", "sdxl": "compile_sdxl_api.json", "flux": "compile_flux_api.json",
            "qwen_image": "compile_qwen_image_api.json", "wan22": "compile_wan22_api.json",
            "ltxv": "compile_ltxv_api.json", "scenes": "compile_stepcache_scenes_api.json",
            "scenes_sd35": "compile_stepcache_scenes_sd35_api.json"}
SCENES = {"scenes": "wan22_14b", "scenes_sd35": "sd35"}  # the reference models with learned weights, by --arch
SIZE_STEP = 16  # a latent side every family's patches divide (8 pixels a latent pixel, patches of 2)

# Each run has a seed of its own, so that ComfyUI runs it rather than serving its cache of an identical prompt; the
# first timed round gives eager and Overdrive the same seed, so that their images can be compared.
FIRST_RUN_SEEDS = {"eager": 41, "overdrive": 43}
COMPARED_SEED = 42


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is named in one line with the choices there are (exit code 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description="Run the example Overdrive workflow headless and time it against eager.")
    parser.add_argument("--arch", default="scenes", choices=[*SCENES, "sd15", "sdxl", *DIT_FAMILIES])
    parser.add_argument("--prompt", help="scenes: the scene to draw (default: the workflow's)")
    parser.add_argument("--checkpoint", help="your own checkpoint (SD) or diffusion-model file (DiT families)")
    parser.add_argument("--workflow", help="API-format workflow (file or name in workflows/); default: the arch's")
    parser.add_argument("--size", type=int, help="image width and height (default: the workflow's on GPU, 256 on CPU)")
    parser.add_argument("--steps", type=int, help="sampling steps (default: the workflow's on GPU, 8 on CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of eager and of Overdrive (median)")
    parser.add_argument("--out", default=str(REPO / "out"), help="where the server's folders and the images go")
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    return args


def argument_problem(args) -> str | None:
    """What is wrong with the arguments, in words naming the value and what would do; None if nothing is."""
    if args.prompt is not None and args.arch not in SCENES:
        return f"--prompt names a scene for the reference models (--arch {' or '.join(SCENES)}), not --arch {args.arch}"
    if args.prompt:
        try:
            scenes.parse(args.prompt)
        except scenes.SceneError as error:
            return f"--prompt {args.prompt!r}: {error.args[0]}"
    if args.checkpoint and not pathlib.Path(args.checkpoint).is_file():
        return f"--checkpoint {args.checkpoint}: no such file"
    if args.workflow and not (pathlib.Path(args.workflow).is_file() or (REPO / "workflows" / args.workflow).is_file()):
        return f"--workflow {args.workflow}: no such file here or in workflows/"
    if args.size is not None and (args.size < SIZE_STEP or args.size % SIZE_STEP):
        return f"--size {args.size}: use a multiple of {SIZE_STEP} pixels, at least {SIZE_STEP}"
    for name in ("steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name} {getattr(args, name)}: use 1 or more"
    return None


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


def prepared_workflow(args, gpu: bool) -> tuple[dict, dict, dict]:
    """(the API workflow, its checkpoints {name: path}, its other model files {folder: {name: path}})."""
    scene_model = SCENES.get(args.arch)
    workflow = load_workflow(args.workflow) if args.workflow else (
        load_workflow(WORKFLOW[args.arch]) if args.arch in WORKFLOW else dit_workflow(args.arch))
    size = "full" if gpu else "tiny"
    checkpoints, files = {}, {}
    if scene_model:
        print("Using the reference model with learned weights: it draws the prompt's colour, size, position and "
              "background (shapes rounded, textures left out).")
        files = learned.files([scene_model])
        if args.checkpoint:
            files["diffusion_models"] = {learned.MODELS[scene_model].model_name: pathlib.Path(args.checkpoint)}
        if args.prompt:
            set_inputs(workflow, "OverdriveBuiltinConditioning", prompt=args.prompt)
    elif args.arch in DIT_FAMILIES:
        print(f"Using the built-in {args.arch} model{' (your file for the diffusion model)' if args.checkpoint else ''}"
              ": fixed-seed random weights, so images look like noise; timings are real.")
        files = builtin_dit_files([args.arch], size)
        if args.checkpoint:
            files["diffusion_models"] = {BUILTIN_DIT_NAMES[args.arch][0]: pathlib.Path(args.checkpoint)}
    else:
        print(f"Using the built-in {args.arch} model: fixed-seed random weights, so images look like noise; timings "
              "are real.")
        name = next(n for n in workflow.values() if n["class_type"] == "CheckpointLoaderSimple")["inputs"]["ckpt_name"]
        checkpoints = {name: pathlib.Path(args.checkpoint) if args.checkpoint else ensure_checkpoint(args.arch, size)}
    small = not gpu and not scene_model  # the reference models are small enough for the CPU at their own size
    if args.size or small:
        set_latent_size(workflow, args.size or 256, args.size or 256, frames=None if gpu else 5)
    if args.steps or small:
        set_inputs(workflow, "KSampler", steps=args.steps or 8)
    return workflow, checkpoints, files


def timed_run(client, server, workflow: dict, label: str, seed: int) -> tuple[float, pathlib.Path]:
    """(seconds for the whole prompt, its image)."""
    set_inputs(workflow, "SaveImage", filename_prefix=f"overdrive-main-{label}")
    set_inputs(workflow, "KSampler", seed=seed)
    start = time.perf_counter()
    entry = client.run(workflow, timeout=3600)
    return time.perf_counter() - start, client.output_files(entry, server.output_dir)[0]


def run_variants(client, server, workflow: dict, repeats: int) -> tuple[dict, dict]:
    """Eager and Overdrive, one untimed run each, then `repeats` rounds of one run each, alternating so that a shared
    machine's load falls on both. Returns ({variant: [seconds]}, {variant: image at the compared seed})."""
    variants = {"eager": without_overdrive(workflow), "overdrive": workflow}
    for variant, graph in variants.items():
        seconds, _ = timed_run(client, server, graph, variant, FIRST_RUN_SEEDS[variant])
        print(f"{variant}, first run ({'loads the model' if variant == 'eager' else 'compiles'}): {seconds:.2f} s")
    timings, images = {variant: [] for variant in variants}, {}
    for round_index in range(repeats):
        seed = COMPARED_SEED if round_index == 0 else COMPARED_SEED + 100 + round_index
        for variant, graph in variants.items():
            seconds, image = timed_run(client, server, graph, variant, seed)
            timings[variant].append(seconds)
            images.setdefault(variant, image)
    return timings, images


def timing_line(variant: str, seconds: list) -> str:
    return (f"{variant:9s} median {statistics.median(seconds):.2f} s of {len(seconds)} runs "
            f"({min(seconds):.2f}-{max(seconds):.2f} s)")


def main(argv=None):
    args = parse_arguments(argv)
    gpu = torch.cuda.is_available()
    workflow, checkpoints, files = prepared_workflow(args, gpu)
    workdir = pathlib.Path(args.out)
    config = model_paths_config(workdir, checkpoints, files)
    with ComfyServer(workdir, extra_args=["--extra-model-paths-config", str(config)]) as server:
        try:
            timings, images = run_variants(ComfyClient(server.url), server, workflow, args.repeats)
        except PromptFailed as error:
            sys.exit(f"{pathlib.Path(__file__).name}: {str(error).splitlines()[0][:400]}\n"
                     f"ComfyUI log: {server.log_path}")
    for variant, seconds in timings.items():
        print(timing_line(variant, seconds))
    pictures = [load_image(images[variant]) for variant in ("overdrive", "eager")]
    summary = (f"Overdrive {statistics.median(timings['eager']) / statistics.median(timings['overdrive']):.2f}x eager "
               f"per prompt (medians); against eager's image at the same seed: PSNR {psnr(*pictures):.1f} dB, "
               f"SSIM {ssim(*pictures):.3f}")
    saved = workdir / "overdrive-main.png"
    side_by_side(images["eager"], images["overdrive"], f"eager | Overdrive\n{summary}", saved)
    print(f"\n{summary} (whole prompt: sampling + VAE decode + save)\n"
          f"Eager's image and Overdrive's, side by side: {saved}\nComfyUI log: {server.log_path}")
    if not gpu:
        print("On the CPU, compiling brings little speed: Overdrive's kernels and CUDA graphs are for NVIDIA GPUs (what "
              "the step cache saves, it saves anywhere). This run checks that the workflow runs end to end.")


if __name__ == "__main__":
    main()
