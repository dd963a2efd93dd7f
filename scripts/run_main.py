"""The main job: a real headless ComfyUI with Overdrive on loopback, the example workflow queued over the HTTP API,
eager vs Overdrive timings printed and the image saved.

  python scripts/run_main.py                        # built-in SD1.5 checkpoint (generated, fixed seed)
  python scripts/run_main.py --checkpoint my.safetensors --workflow compile_sdxl_api.json

Without a GPU it runs small (256², 8 steps) so it finishes in minutes; --size/--steps override.
"""
import argparse
import pathlib
import shutil
import sys
import time

import torch

from overdrive.runner import ComfyClient, ComfyServer
from overdrive.builtin_models import ensure_checkpoint
from overdrive.runner.workflows import load_workflow, model_paths_config, set_inputs, without_overdrive

REPO = pathlib.Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description="Run the example Overdrive workflow headless and time it against eager.")
    parser.add_argument("--checkpoint", help="your own checkpoint file (default: the built-in fixed-seed one)")
    parser.add_argument("--workflow", default="compile_sd15_api.json", help="API-format workflow (file or name in workflows/)")
    parser.add_argument("--size", type=int, help="image width and height (default 512 on GPU, 256 on CPU)")
    parser.add_argument("--steps", type=int, help="sampling steps (default 20 on GPU, 8 on CPU)")
    parser.add_argument("--out", default=str(REPO / "out"), help="where the server's folders and the images go")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    workflow = load_workflow(args.workflow)
    loader = next(n for n in workflow.values() if n["class_type"] == "CheckpointLoaderSimple")
    name = loader["inputs"]["ckpt_name"]
    if args.checkpoint:
        path = pathlib.Path(args.checkpoint)
        if not path.is_file():
            sys.exit(f"--checkpoint {path}: no such file")
    else:
        arch = "sdxl" if "sdxl" in name else "sd15"
        print(f"Using the built-in {arch} checkpoint (fixed-seed random weights; images look like noise, timings are real).")
        path = ensure_checkpoint(arch, "full" if gpu else "tiny", seed=0)
    set_inputs(workflow, "EmptyLatentImage", width=args.size or (512 if gpu else 256), height=args.size or (512 if gpu else 256))
    set_inputs(workflow, "KSampler", steps=args.steps or (20 if gpu else 8))

    workdir = pathlib.Path(args.out)
    config = model_paths_config(workdir, {name: path})
    with ComfyServer(workdir, extra_args=["--extra-model-paths-config", str(config)]) as server:
        client = ComfyClient(server.url)
        timings = {}
        for label, prompt in (("eager", without_overdrive(workflow)), ("overdrive, first run (compiles)", workflow),
                              ("overdrive", workflow), ("eager again", without_overdrive(workflow))):
            set_inputs(prompt, "SaveImage", filename_prefix=f"overdrive-main-{label.split(',')[0].replace(' ', '-')}")
            set_inputs(prompt, "KSampler", seed=42 + len(timings))  # a new seed, so ComfyUI does not serve its cache
            start = time.perf_counter()
            entry = client.run(prompt, timeout=3600)
            timings[label] = time.perf_counter() - start
            image = client.output_files(entry, server.output_dir)[0]
            print(f"{label:34s} {timings[label]:8.2f} s   {image}")
        saved = workdir / "overdrive-main.png"
        shutil.copy(image, saved)
    eager = min(timings["eager"], timings["eager again"])
    print(f"\nOverdrive {eager / timings['overdrive']:.2f}x eager per prompt (whole prompt: sampling + VAE decode + save); "
          f"image: {saved}\nComfyUI log: {server.log_path}")


if __name__ == "__main__":
    main()
