"""What moves a quantized model off a short card at every prompt? The VAE's load: the 8-bit layers count 0 in its size.

The iteration soak's first prompts (eager, Quantize + Compile, + step cache; harness/iteration_soak.py) in ComfyUI's
own executor at an emulated card, with every LoadedModel.model_unload, ModelPatcher.detach, partially_unload and
QuantizedModules move printed with its time, size and the ComfyUI frames that called it, and each prompt's node
seconds (2026-12-06_h100_comfy033_dynamic-on_budget-16gib_flux_full_unload_trace.json). Analysis:
bench/experiments/loras-on-quantized-layers.md.

    python bench/probes/unload_trace.py --size quarter --budget-gib 8 --prompts 6 --out bench/results/x.json
"""
import argparse
import functools
import json
import pathlib
import sys
import tempfile
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/ for iteration_soak's helpers

STARTED = time.perf_counter()
EVENTS = []


def frames() -> str:
    """The calling frames in ComfyUI and Overdrive, innermost last, as file:line function."""
    keep = [f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-3]
            if ("comfy" in f.filename or "overdrive" in f.filename or "execution" in f.filename)
            and "unload_trace" not in f.filename]
    return " < ".join(reversed(keep[-7:]))


def gpu_used_gib():
    from overdrive.harness.iteration_soak import gpu_used_gib as used
    return used()


def traced(owner, name: str, describe):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        began = time.perf_counter()
        result = original(self, *args, **kwargs)
        EVENTS.append({"t": round(began - STARTED, 3), "what": f"{owner.__name__}.{name}",
                       "detail": describe(self, *args), "seconds": round(time.perf_counter() - began, 3),
                       "result": repr(result)[:40], "gpu_gib_after": gpu_used_gib(), "by": frames()})
        print(f"[trace] {EVENTS[-1]}", flush=True)
        return result
    setattr(owner, name, wrapper)


def install_traces() -> None:
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    from overdrive.comfy_host.quantized_follower import QuantizedModules

    def model_name(patcher):
        return type(getattr(patcher, "model", None)).__name__

    traced(mm.LoadedModel, "model_unload", lambda self, memory_to_free=None, *rest: (
        f"{model_name(self.model)} to_free={memory_to_free and memory_to_free / 2**30:.2f} GiB "
        f"loaded={self.model.loaded_size() / 2**30:.2f} GiB"))
    traced(mp.ModelPatcher, "detach", lambda self, unpatch_all=True: f"{model_name(self)} unpatch_all={unpatch_all}")
    for cls in (mp.ModelPatcher, mp.ModelPatcherDynamic):
        traced(cls, "partially_unload", lambda self, device_to, memory_to_free=0, *rest: (
            f"{model_name(self)} to_free={memory_to_free / 2**30:.2f} GiB"))
    traced(QuantizedModules, "to", lambda self, device: f"to {device}")
    traced(QuantizedModules, "on_detach", lambda self, patcher, unpatch_all: f"unpatch_all={unpatch_all}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="quarter", choices=("tiny", "quarter", "full"))
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-gib", type=float)
    parser.add_argument("--dynamic-vram", default="on", choices=("on", "off"))
    parser.add_argument("--prompts", type=int, default=6, help="how many of the soak's first prompts")
    parser.add_argument("--files-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "overdrive-soak-files"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="overdrive-unload-"))
    import os
    os.environ["OVERDRIVE_CACHE_DIR"] = str(workdir / "cache")

    import torch
    from iteration_soak import FOLDERS, USED, soak_files
    from overdrive.harness.executor import InProcessComfy
    from overdrive.harness.iteration_soak import Soak, plan
    directory, cpu = pathlib.Path(args.files_dir), not torch.cuda.is_available()
    comfy = InProcessComfy(workdir / "output", {folder: [directory] for folder in FOLDERS}, cpu=cpu,
                           dynamic_vram=args.dynamic_vram == "on" and not cpu, budget_gib=args.budget_gib)
    files, eight_bit_gib, _ = soak_files(args.size, directory, second_model=False)  # the first prompts read one
    install_traces()
    info = {name: {"input": cls.INPUT_TYPES()} for name, cls in comfy.nodes.NODE_CLASS_MAPPINGS.items()
            if name in USED}
    steps = plan(info, files, args.res, args.steps, cycles=1, stops=False, core=True)[:args.prompts]
    soak = Soak(comfy, log=lambda line: print(line, flush=True))
    for step in steps:
        EVENTS.append({"t": round(time.perf_counter() - STARTED, 3), "what": "prompt", "detail": step.label})
        soak.run([step])
    result = {"bench": "unload_trace", "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
              "dynamic_vram": args.dynamic_vram, "budget_gib": args.budget_gib, "model": f"flux {args.size}",
              "resolution": args.res, "steps": args.steps, "quantized_gib_estimate": round(eight_bit_gib, 2),
              "rows": soak.rows, "events": EVENTS}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
