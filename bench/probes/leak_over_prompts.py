"""Does ComfyUI keep models it let go over prompts? Not 0.33: no leak line in 24 (2026-11-29_cpu_comfy033_leak_over_prompts.json).

Prompts over the HTTP API, four rounds of SD3.5 with Quantize Model, SD1.5, Flux with Compile Model, eager SD3.5 and
Flux (built-in tiny files); after each, ComfyUI's "memory leak with model" lines and the server's resident memory.
Analysis: bench/experiments/models-kept-over-prompts.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/leak_over_prompts.py --workdir DIR --out bench/results/x.json
"""
import argparse
import json
import pathlib
import time

import psutil

from overdrive.builtin_models import ensure_checkpoint
from overdrive.harness.client import ComfyClient
from overdrive.harness.server import start_with_models
from overdrive.harness.workflows import (builtin_dit_files, dit_workflow, load_workflow, prefix_images, set_inputs,
                                        set_latent_size, without_overdrive)

RES, STEPS = 64, 2


def small(workflow, seed, prefix):
    set_inputs(set_latent_size(workflow, RES, RES), "KSampler", steps=STEPS, seed=seed)
    return prefix_images(workflow, prefix)


def quantized_sd35(seed):
    """SD3.5 through Quantize Model in place of Compile Model, every eligible layer in fp8."""
    workflow = dit_workflow("sd35")
    key = next(k for k, node in workflow.items() if node["class_type"] == "OverdriveCompileModel")
    workflow[key] = {"class_type": "OverdriveQuantizeModel", "inputs": {
        "model": workflow[key]["inputs"]["model"], "format": "fp8_e4m3", "bits": 8, "quantize_conv": True,
        "quantize_linear": True, "conv_mse_threshold": 1.0, "linear_mse_threshold": 1.0,
        "compute_density_threshold": 0.0, "min_speedup": 0.0, "calibration_steps": 1,
        "positive": ["3", 0], "negative": ["3", 1], "latent": ["5", 0]}}
    return small(workflow, seed, f"leak-sd35-fp8-{seed}")


def plan(rounds):
    for r in range(rounds):
        yield "sd35 + Quantize Model fp8", quantized_sd35(10 * r + 1)
        yield "sd15 eager", small(without_overdrive(load_workflow("compile_model_sd15_api.json")), r, f"leak-sd15-{r}")
        yield "flux + Compile Model", small(dit_workflow("flux"), r, f"leak-flux-{r}")
        yield "sd35 eager", small(without_overdrive(dit_workflow("sd35")), r, f"leak-sd35-{r}")
        yield "flux eager", small(without_overdrive(dit_workflow("flux")), r, f"leak-flux-eager-{r}")
        yield "sd35 + Quantize Model fp8", quantized_sd35(10 * r + 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    files = builtin_dit_files(("sd35", "flux"))
    checkpoints = {"overdrive-builtin-sd15.safetensors": ensure_checkpoint("sd15", "tiny", seed=0)}
    server = start_with_models(pathlib.Path(args.workdir), checkpoints, files)
    client, rows = ComfyClient(server.url), []
    try:
        process = psutil.Process(server.process.pid)
        for i, (name, workflow) in enumerate(plan(args.rounds)):
            start = time.perf_counter()
            client.run(workflow)
            leaks = sum("memory leak" in line for line in server.log_text().splitlines())
            rows.append({"prompt": i, "workflow": name, "s": round(time.perf_counter() - start, 2),
                         "leak_lines_so_far": leaks, "server_rss_mib": round(process.memory_info().rss / 2**20)})
            print(rows[-1], flush=True)
    finally:
        server.stop()
    import comfyui_version  # noqa: the server's ComfyUI, importable once builtin_dit_files has imported it
    report = {"comfyui": comfyui_version.__version__, "device": "cpu", "res": RES, "steps": STEPS, "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
