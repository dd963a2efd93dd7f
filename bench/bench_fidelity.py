"""How far each accelerator moves the image, on a reference model with learned weights (builtin_models/learned.py):
for every variant, over a set of scene prompts and seeds, the decoded image's PSNR and SSIM against eager's image at
the same prompt and seed, the final latent's relative error, and seconds per image beside eager's.

  python bench/bench_fidelity.py --out bench/results/DATE_GPU_fidelity_scenes_MODEL.json [--model wan22_14b|sd35]
                                 [--prompts 16] [--variants ...]

The models load through ComfyUI's own loaders, sample with its KSampler path (euler, simple) and decode with its VAE,
in one process (harness/fidelity.py). ComfyUI's EasyCache and LazyCache are the step-cache peers (a first-block
cache, as WaveSpeed's, is not installable here). A variant that fails is recorded with its error, not dropped.
"""
import argparse
import json
import pathlib

import torch

from report import environment


def save_picture(path: str, results: list, variants: list, side: int, prompts: int = 6) -> None:
    """A grid: a row per prompt, its columns the scene as the data draws it, eager's image, then each variant's."""
    import numpy as np
    from PIL import Image, ImageDraw

    from overdrive.builtin_models import scenes
    by_name = {row["variant"]: row for row in results if "per_prompt" in row}
    columns = ["eager", *[name for name in variants if name in by_name]]
    rows = []
    for i, prompt_row in enumerate(by_name["eager"]["per_prompt"][:prompts]):
        target = (scenes.render(scenes.parse(prompt_row["prompt"]), side).permute(1, 2, 0) + 1) / 2
        images = [by_name[name]["per_prompt"][i]["outputs"][1][0] for name in columns]
        rows.append(torch.cat([target, *images], dim=1))
    grid = Image.fromarray((torch.cat(rows).clamp(0, 1).numpy() * 255).astype(np.uint8))
    picture = Image.new("RGB", (grid.width, grid.height + 14), "white")
    picture.paste(grid, (0, 14))
    draw = ImageDraw.Draw(picture)
    for i, name in enumerate(["the scene (data)", *columns]):
        draw.text((i * side + 2, 1), name, fill="black")
    picture.save(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="wan22_14b", help="which reference model (builtin_models/learned.py MODELS)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--frames", type=int, default=1, help="video frames (a video model: moving scenes, every "
                                                              "frame compared)")
    parser.add_argument("--variants", help="comma-separated names of harness/fidelity.py's VARIANTS (default: all)")
    parser.add_argument("--picture", help="PNG: per prompt (the first 6) the scene as drawn by the data, eager's "
                                          "image and each --picture-variants' image")
    parser.add_argument("--picture-variants", default="compile,stepcache-default,stepcache2,4bit,lazycache")
    args = parser.parse_args(argv)
    from overdrive.harness.fidelity import VARIANTS, Scenes, measure, scene_prompts
    from overdrive.harness.inprocess import import_comfy
    import_comfy(cpu=not torch.cuda.is_available())
    import overdrive.nodes  # noqa: F401  (ComfyUI's per-call options description, as loading the nodes sets it)

    scenes_model = Scenes(args.steps, args.cfg, args.side, args.model, args.frames)
    prompts = scene_prompts(args.prompts, args.seed, video=args.frames > 1)
    reference = measure(scenes_model, "eager", [], prompts, None)
    eager = {(r["prompt"], r["seed"]): r["outputs"] for r in reference["per_prompt"]}
    results = [reference]
    for name in (args.variants.split(",") if args.variants else VARIANTS):
        if name == "eager":
            continue
        try:
            results.append(measure(scenes_model, name, VARIANTS[name], prompts, eager))
        except Exception as e:  # noqa: BLE001 (a variant that cannot run here is a row of the table)
            results.append({"variant": name, "failed": f"{type(e).__name__}: {e}"[:300]})
        row = results[-1]
        print(f"{name:28s} " + (f"PSNR {row['psnr_mean']:6.2f} dB (median {row['psnr_median']:.2f}, min "
                                f"{row['psnr_min']:.2f})  {row.get('steps_full_reused', '')} SSIM "
                                f"{row['ssim_mean']:.4f}  latent {row['latent_rel_err_mean']:.4f}  "
                                f"{row['s_per_image']:.3f} s/image (eager {reference['s_per_image']:.3f})"
                                if "failed" not in row else f"failed: {row['failed']}"), flush=True)
    if args.picture:
        save_picture(args.picture, results, args.picture_variants.split(","), args.side)
    for row in results:
        for prompt_row in row.get("per_prompt", []):
            prompt_row.pop("outputs")
    report = {"benchmark": "fidelity on the reference model with learned weights", "settings": vars(args),
              "environment": environment(), "results": results}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
