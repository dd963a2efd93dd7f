"""Who keeps the first file's weights after Overdrive's prompts and eager on a second? Four reference cycles.

The iteration soak's prompts on the tiny Flux (CPU, ComfyUI's own executor in this process): eager on each file,
Quantize + Compile and the step cache on the first, eager on the first, then eager on the second. Prints each prompt's
row, then host memory and the ModelPatchers left before and after gc.collect() with malloc_trim. Analysis:
bench/experiments/loras-on-quantized-layers.md.
`--eager-only`: the same files and eager prompts with a LoRA node in place of Overdrive's (the control).

  python3 bench/probes/two_file_cycles_probe.py [--eager-only] [--files-dir DIR]
"""
import argparse
import ctypes
import gc
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: the soak's file helpers
from iteration_soak import FOLDERS, USED, soak_files  # noqa: E402

OVERDRIVE = ("eager", "eager, the second file", "Quantize + Compile, first", "+ step cache", "[1] eager between",
             "[1] eager on the second file")
CONTROL = ("eager", "eager, the second file", "[1] eager + LoRA 0.8", "[1] eager between",
           "[1] eager on the second file")


def patchers_over_diffusion_models():
    import comfy.model_patcher
    found = []
    for obj in gc.get_objects():
        try:  # weak proxies among them raise on type checks
            if issubclass(type(obj), comfy.model_patcher.ModelPatcher) and hasattr(obj.model, "diffusion_model"):
                found.append(obj)
        except ReferenceError:
            continue
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--files-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "overdrive-probe-files"))
    args = parser.parse_args()
    report = sys.__stdout__  # ComfyUI takes sys.stdout over for its log

    from overdrive.harness.executor import InProcessComfy
    from overdrive.harness.iteration_soak import Soak, plan, process_memory
    work, directory = pathlib.Path(tempfile.mkdtemp(prefix="overdrive-probe-")), pathlib.Path(args.files_dir)
    comfy = InProcessComfy(work / "output", {folder: [directory] for folder in FOLDERS}, cpu=True,
                           dynamic_vram=False, budget_gib=None)
    files, _, second = soak_files("tiny", directory)
    second.join()
    info = {n: {"input": c.INPUT_TYPES()} for n, c in comfy.nodes.NODE_CLASS_MAPPINGS.items() if n in USED}
    labels = CONTROL if args.eager_only else OVERDRIVE
    steps = [step for step in plan(info, files, 64, 2, cycles=1, stops=False, core=True) if step.label in labels]
    Soak(comfy, log=lambda line: print(line, file=report, flush=True)).run(steps)

    for when in ("before gc.collect()", "after gc.collect() and malloc_trim"):
        patchers = patchers_over_diffusion_models()
        counts = f"{len(patchers)} patchers over {len({id(p.model) for p in patchers})} diffusion models"
        del patchers  # held here, they would survive the collect
        print(f"{when}: {process_memory()}; {counts}", file=report, flush=True)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)


if __name__ == "__main__":
    main()
