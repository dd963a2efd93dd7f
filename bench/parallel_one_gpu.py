"""Parallel Model's sequence path on one GPU, in a torch.distributed group of one NCCL process: every block sharded,
gathered and attending through the all-to-all as with several GPUs (each collective a copy here), eager and under
Compile Model (its blocks compiled around the collectives, their CUDA graphs recording them and dropped before the
process leaves the group). What one GPU can say before two are lent: the path runs on CUDA with NCCL, how far its
latents are from the model's own, what the machinery costs a step where there is nobody to trade with, and that the
process leaves the group. Dynamic VRAM on, as ComfyUI 0.33 runs on NVIDIA. Per-step time: the median of 3 runs.

  python3 bench/parallel_one_gpu.py [--families flux,wan22] [--size quarter] [--steps 4] [--out FILE]
"""
import argparse
import datetime
import json
import logging
import os
import pathlib
import socket
import sys
import time

import torch
import torch.distributed as dist

from overdrive.harness.inprocess import import_comfy

SIZES = {"flux": dict(width=1024, height=1024, frames=1, cfg=1.0),
         "wan22": dict(width=1280, height=704, frames=33, cfg=1.0)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="flux,wan22")
    parser.add_argument("--size", default="quarter")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    import_comfy(cpu=False, dynamic_vram=True)
    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models import dit
    from overdrive.nodes import NODES
    from overdrive.comfy_host.sequence_split import as_each_process_runs
    from overdrive.parallel.workers import leave_group
    log = logging.getLogger("overdrive")
    log.addHandler(logging.StreamHandler(sys.stdout))
    log.setLevel(logging.INFO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    folder = pathlib.Path("/tmp/overdrive-bench-models")
    rows = []
    for family in options.families.split(","):
        size = SIZES[family]
        path = dit.ensure_diffusion_model(family, options.size, 0, folder)
        base = comfy.sd.load_diffusion_model(str(path))
        latent = dit.empty_latent(family, size["width"], size["height"], size["frames"])
        positive, negative = dit.conditioning(family, 1), dit.conditioning(family, 2)

        def sample(patcher):
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), options.steps, size["cfg"],
                                      "euler", "simple", positive, negative, latent, seed=0, disable_pbar=True)
            torch.cuda.synchronize()
            return dit.flat_latent(out).float(), time.perf_counter() - started

        compiled = NODES["OverdriveCompileModel"].execute(base)[0]
        variants = {"eager": base.clone(), "eager, sequence path": as_each_process_runs(base),
                    "compile": compiled, "compile, sequence path": as_each_process_runs(compiled)}
        outputs = {}
        for name, patcher in variants.items():
            torch.cuda.reset_peak_memory_stats()
            _, first_s = sample(patcher)  # compiles, records the blocks' CUDA graphs at their second call
            runs = [sample(patcher) for _ in range(3)]
            out, step_s = runs[-1][0], sorted(seconds for _, seconds in runs)[1]
            outputs[name] = out
            reference = outputs[name.split(",")[0]]
            error = ((out - reference).norm() / reference.norm()).item()
            rows.append(dict(family=family, size=options.size, variant=name, steps=options.steps,
                             first_run_s=round(first_s, 3), step_s=round(step_s / options.steps, 4),
                             relative_error_vs_plain=error,
                             peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                             **size))
            print(json.dumps(rows[-1]), flush=True)
        del variants, compiled, base
    import comfyui_version
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, comfyui=comfyui_version.__version__,
                  dynamic_vram=True, world_size=1, backend="nccl", date=datetime.date.today().isoformat(), rows=rows)
    card = torch.cuda.get_device_name().split()[-1].lower()  # "NVIDIA H200" -> h200
    day = datetime.date.today().isoformat()
    out = options.out or f"bench/results/{day}_{card}_comfy033_dynamic-on_parallel_one_gpu.json"
    pathlib.Path(out).write_text(json.dumps(report, indent=1))
    print("wrote", out, flush=True)
    started = time.perf_counter()
    leave_group()  # as Parallel Model's pool leaves it when it closes: the blocks' CUDA graphs dropped first
    print(f"left the group in {time.perf_counter() - started:.2f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
