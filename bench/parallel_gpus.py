"""Parallel Model on several GPUs of one host against the same stack (Compile Model) on one GPU, in one run: seconds
per step (median of 3 runs after a warm-up that compiles and starts the workers), the speed-up, each model call's
relative error against the one-GPU run at the same seed, and every GPU's peak memory. Dynamic VRAM on, as ComfyUI
0.33 runs on NVIDIA. The issue's cases: Wan 2.2 5B at 1280x704x121 and the 14B layout at 480p x 81 (CFG 5), Flux.1
1024² (CFG 1), Qwen-Image 1328² (CFG 4); each by `auto` and by each split that applies.

  python3 bench/parallel_gpus.py --gpus 2 [--cases wan22_5b,flux] [--size full] [--steps 4] [--out FILE]
  python3 bench/parallel_gpus.py --cpu --size tiny --steps 1   # the same path on the CPU (gloo), a logic check
"""
import argparse
import datetime
import json
import logging
import pathlib
import statistics
import time

import torch

from overdrive.harness.inprocess import import_comfy

CASES = {"wan22_5b": dict(family="wan22", width=1280, height=704, frames=121, cfg=5.0),
         "wan22_14b": dict(family="wan22_14b", width=832, height=480, frames=81, cfg=5.0),
         "flux": dict(family="flux", width=1024, height=1024, frames=1, cfg=1.0),
         "qwen_image": dict(family="qwen_image", width=1328, height=1328, frames=1, cfg=4.0)}
CPU_SIZE = dict(width=64, height=64, frames=5)  # --cpu: the tiny files at the CPU suite's sizes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--size", default="full")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    cuda = not options.cpu
    import_comfy(cpu=not cuda, dynamic_vram=cuda)
    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models import dit
    from overdrive.nodes import NODES
    from overdrive.comfy_host.parallel_calls import POOLS, parallelize
    logging.getLogger("overdrive").setLevel(logging.INFO)  # ComfyUI's handler prints it
    folder = pathlib.Path("/tmp/overdrive-bench-models")
    rows = []
    for case in options.cases.split(","):
        size = {**CASES[case], **(CPU_SIZE if options.cpu else {})}
        family = size["family"]
        base = comfy.sd.load_diffusion_model(str(dit.ensure_diffusion_model(family, options.size, 0, folder)))
        latent = dit.empty_latent(family, size["width"], size["height"], size["frames"])
        positive, negative = dit.conditioning(family, 1), dit.conditioning(family, 2)

        def sample(patcher):
            calls = []

            def record(apply_model, args):
                out = apply_model(args["input"], args["timestep"], **args["c"])
                calls.append(out.detach().float().cpu())
                return out
            recorded = patcher.clone()
            recorded.set_model_unet_function_wrapper(record)
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            comfy.sample.sample(recorded, comfy.sample.prepare_noise(latent, 0), options.steps, size["cfg"], "euler",
                                "simple", positive, negative, latent, seed=0, disable_pbar=True)
            if cuda:
                torch.cuda.synchronize()
            return calls, (time.perf_counter() - started) / options.steps

        compiled = NODES["OverdriveCompileModel"].execute(base)[0]
        modes = ["auto", "sequence"] + (["cfg"] + (["both"] if options.gpus >= 4 else []) if size["cfg"] > 1 else [])
        variants = {"1 GPU": compiled, **{f"{options.gpus} GPUs, {mode}": parallelize(compiled, options.gpus, cuda,
                                                                                      mode) for mode in modes}}
        reference = None
        for name, patcher in variants.items():
            sample(patcher)  # compiles; the workers start (or load this model) and compile theirs
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if POOLS.pool is not None and name != "1 GPU":
                POOLS.pool.peak_memory()  # resets every process's peak
            runs = [sample(patcher) for _ in range(3)]
            calls, step_s = runs[-1][0], statistics.median(seconds for _, seconds in runs)
            if name == "1 GPU":
                reference = (calls, step_s)
                peaks = [torch.cuda.max_memory_allocated() if cuda else 0]
            else:
                peaks = POOLS.pool.peak_memory() if POOLS.pool is not None else []
            errors = [((out - ref).norm() / ref.norm()).item() for out, ref in zip(calls, reference[0])]
            rows.append(dict(case=case, size=options.size, variant=name, steps=options.steps, step_s=round(step_s, 4),
                             speedup=round(reference[1] / step_s, 3), max_call_error=max(errors),
                             peak_gib_per_gpu=[round(p / 2**30, 2) for p in peaks], **size))
            print(json.dumps(rows[-1]), flush=True)
        POOLS.close()
        del variants, compiled, base
    import comfyui_version
    device = torch.cuda.get_device_name() if cuda else "CPU"
    report = dict(gpu=device, gpus=options.gpus, torch=torch.__version__, comfyui=comfyui_version.__version__,
                  dynamic_vram=cuda, backend="nccl" if cuda else "gloo", date=datetime.date.today().isoformat(),
                  rows=rows)
    card = device.split()[-1].lower()  # "NVIDIA H200" -> h200
    out = options.out or (f"bench/results/{datetime.date.today().isoformat()}_{card}x{options.gpus}_comfy033_"
                          f"dynamic-{'on' if cuda else 'off'}_parallel_gpus.json")
    pathlib.Path(out).write_text(json.dumps(report, indent=1))
    print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
