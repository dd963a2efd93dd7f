"""Which nodes fail on a dynamic-VRAM model from a file? Compile Model on Wan's bf16 file under fp16 (printed, no file).

Each node on the built-in tiny files through Load Diffusion Model's path, every failure's traceback printed; it
leaves without garbage collection (comfy-aimdo's host buffers can crash a process at its end). Since fixed: Compile
Model's clone casts each layer's weights to the layer's dtype (bench/experiments/comfyui-033-dynamic-vram.md).

  python3 bench/probes/dynamic_vram_probe.py wan22 flux
"""
import os
import pathlib
import sys
import traceback

import torch

from overdrive.harness.inprocess import import_comfy

comfy = import_comfy(cpu=False, dynamic_vram=True)
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
import folder_paths  # noqa: E402

from overdrive.builtin_models import dit  # noqa: E402
from overdrive.nodes import NODES as NODES  # noqa: E402

folder = pathlib.Path("/tmp/overdrive-probe-models")
folder_paths.add_model_folder_path("diffusion_models", str(folder))


def sample(model, family):
    latent = dit.empty_latent(family, 64, 64, 5)
    return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 2, 3.0, "euler", "simple",
                               dit.conditioning(family, 1), dit.conditioning(family, 2), latent, seed=7,
                               disable_pbar=True)


for family in sys.argv[1:]:
    files = [dit.ensure_diffusion_model(family, "tiny", seed, folder) for seed in (0, 1)]
    base = comfy.sd.load_diffusion_model(str(files[0]))
    print(family, type(base).__name__, base.model.get_dtype(), base.model.manual_cast_dtype, flush=True)
    steps = {"eager": lambda: base.clone(),
             "compile": lambda: NODES["OverdriveCompileModel"].execute(base)[0],
             "switch": lambda: NODES["OverdriveSwitchDiffusionModel"].execute(base, unet_name=files[1].name)[0]}
    for name, make in steps.items():
        try:
            model = make()
            dtypes = sorted({str(p.dtype) for p in model.model.diffusion_model.parameters()})
            out = sample(model, family)
            print(family, name, "ok", type(model).__name__, dtypes, bool(torch.isfinite(dit.flat_latent(out)).all()),
                  flush=True)
        except Exception:  # noqa: BLE001 - the point is to print it
            print(family, name, "FAILED", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
sys.stdout.flush()
os._exit(0)
