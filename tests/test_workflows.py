"""Every workflow in workflows/ on a real ComfyUI server: its UI twin sends exactly its API graph, every node type
and input it uses exists with valid values, and it runs to an image. New workflow files are picked up as they come."""
import json

import pytest
from PIL import Image

from overdrive.harness.workflow_check import workflow_problems
from overdrive.harness.workflow_formats import api_to_ui, ui_to_api, ui_twin, without_meta
from overdrive.harness.workflows import BUILTIN_NAMES, WORKFLOWS, load_workflow, prefix_images, set_inputs
from test_server import RES, small

API_FILES = sorted(WORKFLOWS.glob("*_api.json"))
each_workflow = pytest.mark.parametrize("path", API_FILES, ids=[p.name.removesuffix("_api.json") for p in API_FILES])


def cpu_sized(workflow):
    """Few steps, a small latent, and the built-in SD1.5 checkpoint where a workflow names the SDXL one: these graphs
    take either, and compiling SDXL takes minutes on a CPU (GPU benchmarks cover it)."""
    for node in workflow.values():
        if node["inputs"].get("ckpt_name") == BUILTIN_NAMES["sdxl"]:
            node["inputs"]["ckpt_name"] = BUILTIN_NAMES["sd15"]
    return small(workflow)


@pytest.fixture(scope="module")
def object_info(client, sdxl_checkpoint):  # the server fixture also holds the built-in DiT files
    return client.object_info()


def test_every_api_workflow_has_its_ui_twin_and_back():
    assert API_FILES, "no workflows found"
    ui_files = {p for p in WORKFLOWS.glob("*.json") if not p.name.endswith("_api.json")}
    assert ui_files == {ui_twin(p) for p in API_FILES}, "run: python3 scripts/make_ui_workflows.py"


@each_workflow
def test_ui_workflow_sends_exactly_the_api_graph(path, object_info):
    api = load_workflow(path)
    sent = ui_to_api(json.loads(ui_twin(path).read_text()), object_info)
    assert without_meta(sent) == without_meta(api), f"{ui_twin(path).name} is stale: python3 scripts/make_ui_workflows.py"
    titles = {key: node["_meta"]["title"] for key, node in api.items() if "_meta" in node}
    assert {key: sent[key]["_meta"]["title"] for key in titles} == titles


@each_workflow
def test_generator_round_trips_the_api_graph(path, object_info):
    api = load_workflow(path)
    assert without_meta(ui_to_api(api_to_ui(api, object_info), object_info)) == without_meta(api)


@each_workflow
def test_node_types_and_inputs_exist_on_the_server(path, object_info):
    assert workflow_problems(load_workflow(path), object_info) == []


def test_the_check_finds_what_the_server_would_refuse(object_info):
    workflow = load_workflow("switch_weights_sd15_api.json")
    set_inputs(workflow, "OverdriveSwitchWeights", ckpt_name="missing.safetensors")
    set_inputs(workflow, "KSampler", steps=0, bogus=1)
    workflow["12"]["inputs"]["vae"] = ["1", 1]  # CLIP into a VAE input
    workflow["2"]["class_type"] = "OverdriveNoSuchNode"
    problems = "\n".join(workflow_problems(workflow, object_info))
    for expected in ("ckpt_name='missing.safetensors' is not one of", "steps=0 is outside [1,",
                     "bogus is not an input", "vae wants VAE but node 1 gives CLIP", "OverdriveNoSuchNode is not a node type"):
        assert expected in problems


@each_workflow
def test_api_workflow_runs_to_an_image(path, client, server):
    workflow = prefix_images(cpu_sized(load_workflow(path)), path.stem)
    saves = sorted(key for key, node in workflow.items() if node["class_type"] == "SaveImage")
    entry = client.run(workflow)
    images = {key: client.output_files({"outputs": {key: entry["outputs"][key]}}, server.output_dir) for key in saves}
    for key, files in images.items():  # one image, or one per frame of a video
        assert files and all(f.name.startswith(f"{path.stem}-{key}") for f in files)
        for file in files:
            with Image.open(file) as image:
                assert image.size == (RES, RES) and len(set(image.tobytes())) > 1  # a real picture, not one colour
