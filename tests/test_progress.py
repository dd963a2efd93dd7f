"""What a user sees while Overdrive compiles: progress messages on the websocket (ComfyUI's progress bar) during
the compile, and Overdrive's one-line summaries in the server log."""
from overdrive.harness.workflows import load_workflow, prefix_images, set_inputs
from test_server import STEPS, small

# Options no other test compiles with, so that this prompt really compiles (graphs are shared per server process).
OPTIONS = {"mode": "default", "cuda_graphs": False, "dynamic": "static"}


def run_followed(client, server, workflow, prefix):
    """(the prompt's websocket messages, what the server logged meanwhile)."""
    prefix_images(set_inputs(workflow, "OverdriveCompileModel", **OPTIONS), prefix)
    log_start = len(server.log_text())
    with client.events() as events:
        prompt_id = client.queue(workflow)
        messages = events.follow([prompt_id])[prompt_id]
    assert not [m for m in messages if m["type"] == "execution_error"]
    return messages, server.log_text()[log_start:]


def progress_of(messages):
    return [m["data"] for m in messages if m["type"] == "progress"]


def test_compiling_shows_progress_and_logs_a_summary(client, server):
    workflow = small(load_workflow("compile_model_sd15_api.json"))
    sampler = next(key for key, node in workflow.items() if node["class_type"] == "KSampler")
    messages, log = run_followed(client, server, workflow, "progress-compile")
    # The compile happens at the first sampling step, on the sampler's progress bar, before its step ticks.
    progress = progress_of(messages)
    compiling = [i for i, p in enumerate(progress) if p["max"] != STEPS]
    sampling = [i for i, p in enumerate(progress) if p["max"] == STEPS]
    assert compiling and sampling and max(compiling) < min(sampling)
    assert {progress[i]["node"] for i in compiling + sampling} == {sampler}
    assert progress[compiling[-1]]["value"] == progress[compiling[-1]]["max"]  # the bar completes when compiling ends
    assert "Overdrive: compiling UNetModel" in log and "finished in" in log
    assert "Overdrive compiled UNetModel" in log and "dynamic=static" in log


def test_a_second_checkpoint_reuses_the_graph_without_compile_progress(client, server):
    workflow = small(load_workflow("switch_weights_sd15_api.json"))
    run_followed(client, server, small(load_workflow("compile_model_sd15_api.json")), "progress-first")
    messages, log = run_followed(client, server, workflow, "progress-switch")
    assert {p["max"] for p in progress_of(messages)} == {STEPS}  # only sampling steps: nothing compiled
    assert "reuses the compiled graph" in log and "switched diffusion-model weights" in log
    assert "Overdrive compiled" not in log
