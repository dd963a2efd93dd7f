"""ComfyUI's own web page in a real headless Chromium: drop UI workflow files onto the canvas as a person would, check
every node loads and the page's prompt, and queue an image and a video workflow with the "Queue Prompt" button, waiting
for their images on the canvas. The files dropped are the fewest that hold every Overdrive node (and a video);
tests/test_workflows.py converts every file the way the page does and runs each through the server."""
import copy
import json
import re
import os
import shutil

import pytest
import requests

from overdrive.harness.workflow_formats import without_meta
from overdrive.harness.workflows import WORKFLOWS, load_workflow, prefix_images
from test_workflows import cpu_sized

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI_FILES = sorted(p for p in WORKFLOWS.glob("*.json") if not p.name.endswith("_api.json"))
DROPPED = ("compile_quantize_deepcache_sd15", "switch_weights_sd15", "compile_stepcache_flux", "compile_wan22")
# Queued from the page to their images (an image and a video); the others are queued up to the prompt the page would
# send, which tests/test_workflows.py runs through the server (their CPU compile and quantize took 96 s twice here)
QUEUED_HERE = ("compile_stepcache_flux", "compile_wan22")
pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="Chromium is not installed (Debian package "
                                "chromium; scripts/install.sh --tests installs it)")

DROP = """([name, text]) => {
    const data = new DataTransfer();
    data.items.add(new File([text], name, {type: "application/json"}));
    return data;
}"""
SET_WIDGETS = """(changes) => {
    for (const [id, values] of Object.entries(changes))
        for (const widget of app.graph.getNodeById(+id).widgets)
            if (widget.name in values) widget.value = values[widget.name];
    const right = Math.max(...app.graph._nodes.map(n => n.pos[0] + n.size[0]));
    const bottom = Math.max(...app.graph._nodes.map(n => n.pos[1] + n.size[1]));
    app.canvas.ds.scale = Math.min(1, (innerWidth - 260) / (right + 40), innerHeight / (bottom + 40));
    app.canvas.ds.offset = [0, 0];
    app.graph.setDirtyCanvas(true, true);
}"""
QUEUED = "async () => (await app.graphToPrompt()).output"  # what "Queue Prompt" sends
QUEUE_BUTTON = re.compile(r"^\s*(Queue Prompt|Run)\s*$")  # older frontends' label; ComfyUI 0.7's says "Run"
NOT_BLOCKED = "document.querySelector('.p-blockui-mask:not(.p-overlay-mask-leave)') === null"
# An error dialog, or every Save Image node showing its loaded images on the canvas.
OUTCOME = """() => {
    const dialog = app.ui.dialog.element;
    if (getComputedStyle(dialog).display !== "none") return {dialog: dialog.innerText};
    const saves = app.graph._nodes.filter(n => n.type === "SaveImage");
    const shown = saves.every(n => n.imgs?.length && n.imgs.every(i => i.complete && i.naturalWidth > 0));
    return shown ? {images: saves.map(n => app.nodeOutputs[n.id].images.map(i => i.filename))} : null;
}"""


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    # A first visit opens the template browser over the canvas (ComfyUI's new-user tutorial); a returning user's
    # setting skips it, as it would for anyone who has used ComfyUI before.
    requests.post(f"{server.url}/settings/Comfy.TutorialCompleted", json=True, timeout=10).raise_for_status()
    page = browser.new_page(viewport={"width": 1920, "height": 1080})
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(error))
    page.goto(server.url)
    page.wait_for_function("window.app?.graph && 'KSampler' in LiteGraph.registered_node_types")
    yield page
    page.close()


def drop_file(page, path):
    """A real drop event carrying the file, dispatched on the canvas (ComfyUI's handler reads it with FileReader)."""
    data = page.evaluate_handle(DROP, [path.name, path.read_text()])
    page.dispatch_event("#graph-canvas", "dragover", {"dataTransfer": data})
    page.dispatch_event("#graph-canvas", "drop", {"dataTransfer": data})


def edits(api, runnable) -> dict:
    """{node id: {widget: value}} that turn the workflow `api` into `runnable`."""
    changes = {key: {name: value for name, value in node["inputs"].items() if value != api[key]["inputs"][name]}
               for key, node in runnable.items()}
    return {key: values for key, values in changes.items() if values}


def test_the_dropped_files_hold_every_overdrive_node():
    def overdrive_nodes(paths):
        return {node["type"] for path in paths for node in json.loads(path.read_text())["nodes"]
                if node["type"].startswith("Overdrive")}
    assert overdrive_nodes(WORKFLOWS / f"{name}.json" for name in DROPPED) == overdrive_nodes(UI_FILES)


@pytest.mark.parametrize("name", DROPPED)
def test_dropped_workflow_loads_and_queues_to_an_image(name, page, server, tmp_path):
    """Every node loads, the page sends the API file's prompt, and the widgets a person sets give the runnable one;
    QUEUED_HERE run from the Queue button to their images on the canvas."""
    path = WORKFLOWS / f"{name}.json"
    ui, api = json.loads(path.read_text()), load_workflow(path.with_name(f"{path.stem}_api.json"))
    drop_file(page, path)
    page.wait_for_function("(ids) => app.graph._nodes.map(n => n.id).sort((a, b) => a - b).join() === ids",
                           arg=",".join(str(i) for i in sorted(node["id"] for node in ui["nodes"])))
    assert page.locator(".comfy-missing-nodes").count() == 0
    assert page.evaluate("app.graph._nodes.filter(n => !(n.type in LiteGraph.registered_node_types)).map(n => n.type)") == []
    assert without_meta(page.evaluate(QUEUED)) == without_meta(api)  # newer frontends send titles as _meta

    # Smaller and quicker, as a person would set it in the widgets; then "Queue Prompt".
    prefix = f"browser-{path.stem}"
    runnable = prefix_images(cpu_sized(copy.deepcopy(api)), prefix)
    page.evaluate(SET_WIDGETS, edits(api, runnable))
    assert without_meta(page.evaluate(QUEUED)) == without_meta(runnable)
    if name not in QUEUED_HERE:
        return
    # The frontend blocks the page with a mask while it is busy (a person waits for it too). Once unblocked, the mask
    # plays a fade-out and is removed when that animation ends; on a loaded 2-core machine that removal outlasted a 30 s
    # wait (CI, compile_qwen_image) and once a 300 s one (compile_wan22), so a mask that is leaving does not block the
    # click, which goes to the button itself.
    page.wait_for_function(NOT_BLOCKED, timeout=300_000, polling=500)
    page.get_by_role("button", name=QUEUE_BUTTON).first.dispatch_event("click")
    outcome = page.wait_for_function(OUTCOME, timeout=900_000, polling=500).json_value()
    page.screenshot(path=str(tmp_path / f"{path.stem}.png"))
    assert "dialog" not in outcome, outcome.get("dialog")
    saves = [node for node in ui["nodes"] if node["type"] == "SaveImage"]
    assert len(outcome["images"]) == len(saves) and all(files for files in outcome["images"])  # a video: one a frame
    for filename in (name for files in outcome["images"] for name in files):
        assert filename.startswith(prefix) and (server.output_dir / filename).is_file()
    assert (tmp_path / f"{path.stem}.png").stat().st_size > 0 and page.errors == []
