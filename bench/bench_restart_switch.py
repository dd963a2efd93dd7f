"""GPU benchmark of what users wait for besides sampling: the first image cold, the first image after a restart with
Overdrive's disk cache warm, and (UNets) SwitchWeights to a second checkpoint of the same architecture (file in the
page cache), with Dynamo graph counts. Each phase runs in a fresh process; the driver prints a table.

  python bench/bench_restart_switch.py --arch sdxl --res 1024 --out bench/results/x.json
  python bench/bench_restart_switch.py --arch flux --res 1024 --switches 0 --out bench/results/y.json
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch


def phase(args):
    """One fresh process: build the model, compile with Overdrive, time the first image (and optionally a switch)."""
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("overdrive").setLevel(logging.INFO)  # what was compiled, loaded, precompiled, with timings
    from overdrive.builtin_models import dit
    from overdrive.harness.inprocess import build_dit_model, build_model, conditioning, import_comfy, save_unet_checkpoint
    comfy = import_comfy(cpu=not torch.cuda.is_available())
    import comfy.sample
    import folder_paths
    from overdrive.compiler import dynamo_graph_count
    from overdrive.nodes.compile_nodes import OverdriveCompileModel
    from overdrive.nodes.switch_weights_node import OverdriveSwitchWeights
    from report import compile_phases

    is_dit = args.arch in dit.FAMILIES
    dtype = (torch.bfloat16 if is_dit else torch.float16) if torch.cuda.is_available() else torch.float32
    t0 = time.perf_counter()
    base = build_dit_model(comfy, args.arch, args.size, dtype) if is_dit else build_model(comfy, args.arch, args.size,
                                                                                         dtype)
    build_s = time.perf_counter() - t0
    if is_dit:
        positive, negative = dit.conditioning(args.arch, 1), dit.conditioning(args.arch, 2)
        latent = dit.empty_latent(args.arch, args.res, args.res, args.frames)
        scheduler, cfg = "simple", dit.FAMILIES[args.arch].sampling["cfg"]
    else:
        positive, negative = conditioning(args.arch, args.res, args.res, seed=1)
        latent = torch.zeros(1, 4, args.res // 8, args.res // 8)
        scheduler, cfg = "normal", 7.0
    noise = comfy.sample.prepare_noise(latent, 42)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def sample(model, steps=None):
        sync()
        start = time.perf_counter()
        out = comfy.sample.sample(model, noise, steps or args.steps, cfg, "euler", scheduler, positive, negative, latent,
                                  seed=42, disable_pbar=True)
        sync()
        return out, time.perf_counter() - start

    result = {"phase": args.phase, "build_model_s": round(build_s, 2)}
    compiled = OverdriveCompileModel.execute(base, precompile=args.precompile == "on")[0]
    graphs = dynamo_graph_count()
    if args.cprofile and args.phase == "warm":  # where a warm start's first image spends its host time
        from bench_compile import cprofile_run
        cprofile_run(lambda: result.__setitem__("first_image_s", sample(compiled)[1]))
    else:
        _, result["first_image_s"] = sample(compiled)
    _, result["second_image_s"] = sample(compiled)
    result["graphs_compiled"] = dynamo_graph_count() - graphs
    result["compile_overhead_s"] = round(result["first_image_s"] - result["second_image_s"], 2)
    result["compile_phases_s"] = compile_phases()
    if args.phase == "warm" and not is_dit and not args.no_switch:  # DiT files' switch: not measured here
        folder = pathlib.Path(args.workdir) / "checkpoints"
        folder.mkdir(exist_ok=True)
        other = build_model(comfy, args.arch, args.size, dtype, seed=1)
        save_unet_checkpoint(other, folder / "second.safetensors")
        if args.switches:  # the first checkpoint's own weights, to switch back and forth
            save_unet_checkpoint(base, folder / "first.safetensors")
        del other
        (folder / "second.safetensors").read_bytes()  # into the page cache, as a recently used checkpoint is
        folder_paths.add_model_folder_path("checkpoints", str(folder))
        from overdrive.compiler.switch_weights import read_safetensors_subset, reference_tensors
        start = time.perf_counter()  # the file read alone (page cache -> tensors), to split the switch's time
        read_safetensors_subset(folder / "second.safetensors", reference_tensors(compiled.model.diffusion_model))
        result["switch_file_read_s"] = round(time.perf_counter() - start, 3)
        graphs = dynamo_graph_count()
        start = time.perf_counter()
        switched = OverdriveSwitchWeights.execute(compiled, "second.safetensors")[0]
        result["switch_node_s"] = round(time.perf_counter() - start, 3)
        _, result["first_image_after_switch_s"] = sample(switched)  # includes moving weights to the GPU, re-recording
        _, result["second_image_after_switch_s"] = sample(switched)
        result["graphs_compiled_by_switch"] = dynamo_graph_count() - graphs
        if args.switches and torch.cuda.is_available():
            result.update(switch_memory(args, compiled, sample_steps=2, sample=sample, comfy=comfy))
    print("RESULT " + json.dumps(result), flush=True)


def switch_memory(args, compiled, sample_steps, sample, comfy):
    """`args.switches` switches back and forth between the two checkpoints, one short image after each: GPU memory
    allocated after each image (issue 4: no growth over 20 switches)."""
    from overdrive.nodes.switch_weights_node import OverdriveSwitchWeights
    allocated = []
    current = compiled
    for i in range(args.switches):
        current = OverdriveSwitchWeights.execute(current, "second.safetensors" if i % 2 == 0 else "first.safetensors")[0]
        comfy.model_management.cleanup_models()  # what ComfyUI's executor does before each prompt: unreferenced models go
        sample(current, steps=sample_steps)
        torch.cuda.synchronize()
        allocated.append(round(torch.cuda.memory_allocated() / 2**30, 3))
    del current
    return {"switches": args.switches, "allocated_gib_after_each_switch": allocated,
            "allocated_growth_gib": round(max(allocated) - allocated[0], 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sdxl")
    parser.add_argument("--size", default="full")
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frames", type=int, default=33, help="video families: frames")
    parser.add_argument("--out")
    parser.add_argument("--phase")
    parser.add_argument("--no-switch", action="store_true", help="UNets: time the restart only, no SwitchWeights")
    parser.add_argument("--cprofile", action="store_true", help="profile the warm phase's first image (host time by "
                        "function; the first image's time then includes the profiler's overhead)")
    parser.add_argument("--workdir")
    parser.add_argument("--precompile", choices=("on", "off"), default="on",
                        help="CompileModel's precompile option (saved frames; on by default, as in the node)")
    parser.add_argument("--switches", type=int, default=20, help="switches back and forth after the timed one, for "
                        "GPU memory growth (0: none)")
    args = parser.parse_args()
    if args.phase:
        return phase(args)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="overdrive-bench-"))
    rows = []
    for name in ("cold", "warm"):
        env = dict(os.environ, OVERDRIVE_CACHE_DIR=str(workdir / "overdrive"),
                   TORCHINDUCTOR_CACHE_DIR=str(workdir / f"inductor-{name}"))  # only Overdrive's own cache carries over
        cmd = [sys.executable, __file__, "--phase", name, "--workdir", str(workdir), "--arch", args.arch,
               "--size", args.size, "--res", str(args.res), "--steps", str(args.steps), "--frames", str(args.frames),
               "--switches", str(args.switches), "--precompile", args.precompile]
        cmd += (["--cprofile"] if args.cprofile else []) + (["--no-switch"] if args.no_switch else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if args.cprofile:
            print("\n".join(l for l in out.stdout.splitlines() if not l.startswith("RESULT ")))
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not lines:
            print(out.stdout[-3000:], out.stderr[-5000:])
            raise SystemExit(f"phase {name} failed")
        rows.append(json.loads(lines[-1][7:]))
        rows[-1]["log"] = [line[:400] for line in out.stderr.splitlines() if "Overdrive" in line]
        print(json.dumps(rows[-1]), flush=True)
    from report import environment
    report = {"benchmark": "restart_switch", "settings": vars(args), "environment": environment(), "results": rows,
              "cache_mb": round(sum(p.stat().st_size for p in (workdir / "overdrive").rglob("*.bin")) / 1e6, 1)}
    print(json.dumps(report["environment"]), "cache MB:", report["cache_mb"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
