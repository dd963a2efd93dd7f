"""The iteration soak (harness/iteration_soak.py) on Flux.1: one long-lived ComfyUI (its own prompt executor and output
cache, started as main.py starts it, dynamic VRAM on by default on NVIDIA; harness/executor.py), a card of --budget-gib
emulated, 40+ prompts that change LoRA strengths and files, the prompt, the size and the model, eager prompts between,
stops while compiling and calibrating, /free. Per prompt: time, host memory (anonymous and file-backed), GPU memory in
use, compiles, calibrations and leak warnings; then the summary the issue asks for. Last, a new process on the same
caches: a file never quantized, then the first one.

    python bench/iteration_soak.py --size full --budget-gib 16 --dynamic-vram on --out bench/results/x.json

Everything starts cold: the caches live under --workdir (default: a new temporary folder).
"""
import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import threading


FOLDERS = ("diffusion_models", "vae", "loras")  # the ComfyUI model folders the soak's files are read from


def soak_files(size: str, directory: pathlib.Path, second_model: bool = True):
    """(Files, GiB of the block linears' weights in 8 bits, the thread writing the second model), written into
    `directory` once. The second model is first read well into the soak: it is written beside the first prompts (a
    full-size Flux file took about a minute of a GPU call's ten). Without `second_model` (a run of the first prompts
    only), the first model stands in its place and nothing more is written."""
    from overdrive.builtin_models.dit import diffusion_model_name, ensure_diffusion_model, ensure_vae
    from overdrive.builtin_models.lora import block_linears, ensure_lora
    from overdrive.harness.iteration_soak import Files
    model = ensure_diffusion_model("flux", size, 0, directory)
    other_seed = 1 if second_model else 0
    other = threading.Thread(target=ensure_diffusion_model, args=("flux", size, other_seed, directory), daemon=True)
    other.start()
    vae = ensure_vae("flux", size, 0, directory)
    loras = [ensure_lora(model, directory, rank=16, seed=seed) for seed in (0, 1)]
    eight_bit = sum(out * inp for _, out, inp in block_linears(model)) / 2**30
    files = Files(model.name, diffusion_model_name("flux", size, other_seed), vae.name, tuple(p.name for p in loras))
    return files, eight_bit, other


def run(args) -> tuple:
    """(rows, GiB of the quantized layers) of this process's phase."""
    import torch
    from overdrive.harness.executor import InProcessComfy
    from overdrive.harness.iteration_soak import Soak, plan, restart_plan

    cpu, directory = not torch.cuda.is_available(), pathlib.Path(args.files_dir)
    # ComfyUI first (the files' layouts are read off its classes), reading the folder the files go to
    comfy = InProcessComfy(pathlib.Path(args.workdir) / "output", {folder: [directory] for folder in FOLDERS}, cpu=cpu,
                           dynamic_vram=args.dynamic_vram == "on" and not cpu, budget_gib=args.budget_gib)
    if args.profile_quantize:
        profile_quantize_runs()
    files, eight_bit_gib, other_written = soak_files(args.size, directory)
    info = {name: {"input": cls.INPUT_TYPES()} for name, cls in comfy.nodes.NODE_CLASS_MAPPINGS.items()
            if name in USED}
    steps = (plan(info, files, args.res, args.steps, args.cycles, not args.no_stops, args.core) if args.phase == "soak"
             else restart_plan(info, files, args.res, args.steps))
    # On stderr: a build's stdout redirect (a thread writing the second model) would swallow the rows meanwhile
    soak = Soak(comfy, log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.profile_restart and args.phase == "restart":
        comfy.run = profiled("Restart prompt", comfy.run, top=50)
    first_other = next((i for i, step in enumerate(steps) if files.other in json.dumps(step.prompt)), len(steps))
    soak.run(steps[:first_other])
    other_written.join()
    return soak.run(steps[first_other:]), eight_bit_gib


USED = ("LoraLoaderModelOnly", "OverdriveQuantizeModel", "OverdriveCompileModel", "OverdriveDeepCache",
        "OverdriveSwitchDiffusionModel", "OverdriveBuiltinConditioning")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=("tiny", "quarter", "full"))
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--budget-gib", type=float)
    parser.add_argument("--dynamic-vram", default="on", choices=("on", "off"))
    parser.add_argument("--no-stops", action="store_true", help="leave out the stops and /free")
    parser.add_argument("--core", action="store_true",
                        help="leave out the steps that compile or calibrate anew (size change, Compile Model alone, "
                             "stops): for a model too large to run them all in one GPU call")
    parser.add_argument("--workdir", help="caches, files and images (default: a new temporary folder)")
    parser.add_argument("--files-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "overdrive-soak-files"),
                        help="the generated diffusion models, VAE and LoRAs (kept between runs)")
    parser.add_argument("--phase", default="soak", choices=("soak", "restart"))
    parser.add_argument("--from-log", help="write the result from this soak log's prompt lines instead of running (a "
                        "run a GPU call's time limit cut); with --gpu and the settings it ran with")
    parser.add_argument("--gpu", help="with --from-log: the GPU's name as torch gives it")
    parser.add_argument("--profile-quantize", action="store_true",
                        help="log where each Quantize Model run's own time goes (cProfile, the top functions)")
    parser.add_argument("--profile-restart", action="store_true",
                        help="log where each restart prompt's time goes (cProfile over ComfyUI's executor, which runs "
                             "the nodes in this thread)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.from_log:
        return write_from_log(args)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="overdrive-soak-")
    os.environ["OVERDRIVE_CACHE_DIR"] = str(pathlib.Path(args.workdir) / "cache")  # cold, and shared by the restart

    rows, eight_bit_gib = run(args)
    if args.phase == "restart":
        pathlib.Path(args.out).write_text(json.dumps(rows))
        return
    from overdrive.harness.iteration_soak import summary, write
    import torch
    meta = {"bench": "iteration_soak", "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "comfyui": comfyui_version(),
            "torch": torch.__version__, "python": platform.python_version(), "dynamic_vram": args.dynamic_vram,
            "budget_gib": args.budget_gib, "model": f"flux {args.size}", "resolution": args.res, "steps": args.steps,
            "quantized_gib_estimate": round(eight_bit_gib, 2)}
    result = summary(rows, eight_bit_gib)
    # Written before the restart too: a GPU call's time limit that cuts the restart leaves the soak's result
    write(args.out, rows, {**meta, "ended": "the restart did not finish", "summary": result})
    restart_out = pathlib.Path(args.workdir) / "restart.json"
    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--phase", "restart", "--workdir", args.workdir,
                    "--out", str(restart_out)], check=True)
    restart = json.loads(restart_out.read_text())
    result["restart_seconds"] = {row["label"]: row["seconds"] for row in restart}
    write(args.out, rows + restart, {**meta, "summary": result})
    print(json.dumps(result, indent=1), flush=True)


def profile_quantize_runs() -> None:
    """Each Quantize Model run that calibrates or quantizes (not one reusing this process's layers) under cProfile."""
    from overdrive.comfy_host import quantized_model
    quantized_model.quantize_once = profiled("Quantize Model", quantized_model.quantize_once)


def profiled(what: str, function, top: int = 25):
    """`function` under cProfile at each call, its top functions by cumulative and by own time printed to stderr (the
    soak's log)."""
    import cProfile
    import io
    import pstats

    def run(*args, **kwargs):
        profile = cProfile.Profile()
        try:
            return profile.runcall(function, *args, **kwargs)
        finally:
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("cumulative").print_stats(top)
            stats.sort_stats("tottime").print_stats(top)
            print(f"{what} profile:\n" + text.getvalue(), file=sys.stderr, flush=True)
    return run


def comfyui_version() -> str:
    """The version of the ComfyUI this checkout runs (the GPU machine runs the same carried archive)."""
    from overdrive.harness.server import find_comfyui
    return (find_comfyui() / "comfyui_version.py").read_text().split('"')[1]


def write_from_log(args) -> None:
    """The result of a soak cut before its end, from its log: the prompts it finished, the summary over them, and
    the 8-bit layers' size where the log names it (the pinned home's line)."""
    import re
    from overdrive.harness.iteration_soak import rows_from_log, summary, write
    text = pathlib.Path(args.from_log).read_text()
    home = re.search(r"page-locked host memory \(([\d.]+) GiB", text)
    rows, quantized_gib = rows_from_log(text), float(home[1]) if home else None
    meta = {"bench": "iteration_soak", "gpu": args.gpu, "comfyui": comfyui_version(),
            "dynamic_vram": args.dynamic_vram, "budget_gib": args.budget_gib, "model": f"flux {args.size}",
            "resolution": args.res, "steps": args.steps,
            "plan": "core" if args.core else "full", "quantized_gib": quantized_gib,
            "ended": "cut by the GPU call's time limit after these prompts; rows read from the run's log",
            "summary": summary(rows, quantized_gib)}
    write(args.out, rows, meta)
    print(json.dumps(meta["summary"], indent=1), flush=True)


if __name__ == "__main__":
    main()
