"""Overdrive inside a real ComfyUI server, driven over its HTTP API as users' clients do."""
import copy
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from overdrive.harness.workflows import load_workflow, set_inputs, set_latent_size, without_overdrive

RES, STEPS = 64, 3  # CPU-sized; the same workflow file runs at 512² / 20 steps on a GPU
TOLERANCE = 1e-3  # relative error of compiled vs eager final latents (float32 CPU; measured ~1e-5)


def small(workflow):
    """RES² (and 5 frames for video), STEPS steps, whichever latent node the workflow uses."""
    return set_inputs(set_latent_size(workflow, RES, RES, frames=5), "KSampler", steps=STEPS)


def with_latent_output(workflow, prefix):
    workflow = copy.deepcopy(workflow)
    sampler = next(k for k, v in workflow.items() if v["class_type"] == "KSampler")
    workflow["100"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": prefix}}
    set_inputs(workflow, "SaveImage", filename_prefix=prefix)
    return workflow


def latent_of(entry, server):
    from overdrive.harness import ComfyClient
    (path,) = ComfyClient.output_files(entry, server.output_dir, "latents")
    return load_file(str(path))["latent_tensor"]


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_nodes_are_registered_through_the_v3_entrypoint_with_tooltips(client):
    from overdrive.nodes import NODES

    info = client.object_info()
    for name in NODES:
        assert name in info, f"{name} missing from /object_info"
        node = info[name]
        assert node["category"].startswith("overdrive") and node["display_name"].endswith("(Overdrive)")
        assert node["description"] and all(node["output_tooltips"]), name
        for input_name, spec in {**node["input"]["required"], **node["input"].get("optional", {})}.items():
            assert len(spec) > 1 and spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
    assert info["OverdriveCompileModel"]["input"]["required"]["mode"][1]["options"][0] == "default"


def test_the_server_runs_this_repositorys_overdrive_with_folders_of_its_own(server):
    """Another clone or a worktree on the machine (or ComfyUI's own custom_nodes link) is not what the server loads:
    its custom node and its `import overdrive` are this repository, its user folder is its own, and no database lock
    is shared with another ComfyUI."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    loaded = re.findall(r"seconds: (\S*custom_nodes\S*)$", server.log_text(), re.M)
    assert [pathlib.Path(path).resolve() for path in loaded] == [repo], loaded
    environ = dict(item.split("=", 1) for item in
                   pathlib.Path(f"/proc/{server.process.pid}/environ").read_text().split("\0") if "=" in item)
    probe = subprocess.run([sys.executable, "-c", "import overdrive; print(overdrive.__file__)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": environ["PYTHONPATH"]}, check=True)
    assert pathlib.Path(probe.stdout.strip()).resolve().parent == repo
    assert (server.workdir / "user").is_dir() and "lock on database" not in server.log_text()


def test_compiled_workflow_runs_to_an_image_equal_to_eager(client, server):
    workflow = small(load_workflow("compile_sd15_api.json"))
    eager = client.run(with_latent_output(without_overdrive(workflow), "eager"))
    compiled = client.run(with_latent_output(workflow, "compiled"))
    (image,) = client.output_files(compiled, server.output_dir)
    assert image.is_file() and image.stat().st_size > 0
    reference, out = latent_of(eager, server), latent_of(compiled, server)
    assert torch.isfinite(out).all() and relative_error(out, reference) < TOLERANCE
    log = server.log_text()
    assert "Overdrive compiled UNetModel" in log and "Overdrive compiled AutoencoderKL" in log


def test_forced_compile_failure_falls_back_to_eager_with_a_warning(tmp_path, builtin_checkpoints):
    from conftest import start_server
    from overdrive.harness import ComfyClient

    # A real failure: Inductor cannot build its kernels when the C++ compiler is broken (fresh caches, so it must).
    env = {"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "OVERDRIVE_CACHE_DIR": str(tmp_path / "overdrive")}
    server = start_server(tmp_path / "comfyui", builtin_checkpoints, env=env)
    try:
        client = ComfyClient(server.url)
        workflow = small(load_workflow("compile_model_sd15_api.json"))  # the UNet's compile alone is enough to fail
        # One graph: regions would fail first and then the whole graph (tests/test_regions.py covers that path).
        set_inputs(workflow, "OverdriveCompileModel", regional=False)
        eager = client.run(with_latent_output(without_overdrive(workflow), "eager"))
        compiled = client.run(with_latent_output(workflow, "fallback"))
        assert client.output_files(compiled, server.output_dir)[0].is_file()
        assert relative_error(latent_of(compiled, server), latent_of(eager, server)) < TOLERANCE
        assert "runs eager from now on" in server.log_text()
    finally:
        server.stop()


def test_overdrives_errors_reach_the_api_under_a_stable_type(client):
    """ComfyUI reports an error's type as its class's module and name, and names a custom node's modules by the
    folder's path: Overdrive's own errors read `overdrive.<module>.<class>` there, on every machine, and their
    message starts with the class name."""
    from overdrive.builtin_models import learned

    switched = load_workflow("compile_stepcache_scenes_api.json")  # the video DiT switched onto the MMDiT's file
    switched["10"] = {"class_type": "OverdriveSwitchDiffusionModel",
                      "inputs": {"model": ["2", 0], "unet_name": learned.MODELS["sd35"].model_name}}
    set_inputs(switched, "OverdriveDeepCache", model=["10", 0])
    misspelled = set_inputs(load_workflow("compile_stepcache_scenes_api.json"), "OverdriveBuiltinConditioning",
                            prompt="large crimson circle")
    for workflow, module, name in ((switched, "overdrive.compiler.switch_weights", "WeightMismatchError"),
                                   (misspelled, "overdrive.builtin_models.scenes", "SceneError")):
        status = client.finished(client.queue(workflow))["status"]
        (error,) = [data for kind, data in status["messages"] if kind == "execution_error"]
        assert error["exception_type"] == f"{module}.{name}", error["exception_type"]
        assert error["exception_message"].startswith(f"{name}: "), error["exception_message"]


def test_bad_input_is_refused_with_a_clear_message(client):
    from overdrive.harness.client import PromptFailed

    workflow = small(load_workflow("compile_sd15_api.json"))
    set_inputs(workflow, "OverdriveCompileModel", mode="fastest")
    with pytest.raises(PromptFailed, match="mode"):
        client.run(workflow)
