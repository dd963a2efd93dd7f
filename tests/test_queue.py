"""Headless queueing as API users do it: several prompts at once over HTTP, followed on the websocket, with one
refused at validation and one failing while it runs; every other prompt still runs, in order, to its own image."""
from overdrive.harness.client import PromptFailed
from overdrive.harness.workflows import load_workflow, prefix_images, set_inputs, without_overdrive
from test_server import STEPS, small

SD15_SEED1 = "overdrive-builtin-sd15-seed1.safetensors"


def prompt(name, prefix, seed, **changes):
    """A CPU-sized workflow with its own seed and file prefixes; `changes` are {class_type: {input: value}}."""
    workflow = small(load_workflow(name))
    set_inputs(workflow, "KSampler", seed=seed)
    prefix_images(workflow, prefix)
    for class_type, values in changes.items():
        set_inputs(workflow, class_type, **values)
    return workflow


def batch(sdxl_name):
    """(label, workflow, how it should end): mixed settings, both SD1.5 checkpoints, one refused, one failing."""
    return [
        ("compiled", prompt("compile_sd15_api.json", "queue-compiled", 1), "image"),
        ("other checkpoint", prompt("compile_model_sd15_api.json", "queue-seed1ckpt", 2, CheckpointLoaderSimple={
            "ckpt_name": SD15_SEED1}, KSampler={"sampler_name": "dpmpp_2m", "scheduler": "karras", "cfg": 5.0}), "image"),
        ("invalid mode", prompt("compile_sd15_api.json", "queue-invalid", 3, OverdriveCompileModel={"mode": "fastest"}),
         "refused"),
        ("other architecture", prompt("switch_weights_sd15_api.json", "queue-mismatch", 4,
                                      OverdriveSwitchWeights={"ckpt_name": sdxl_name}), "error"),
        ("switched weights", prompt("switch_weights_sd15_api.json", "queue-switched", 5), "image"),
        ("eager", without_overdrive(prompt("compile_sd15_api.json", "queue-eager", 6, KSampler={"steps": STEPS - 1})),
         "image"),
    ]


def queue_all(client, prompts):
    """Queue every prompt at once; {label: prompt id} of those accepted, {label: reason} of those refused."""
    accepted, refused = {}, {}
    for label, workflow, _ in prompts:
        try:
            accepted[label] = client.queue(workflow)
        except PromptFailed as error:
            refused[label] = str(error)
    return accepted, refused


def images_of(workflow, messages, server) -> list:
    """The images one finished prompt announced on the websocket: one per Save Image node, each its own file."""
    kinds = [m["type"] for m in messages]
    assert "execution_error" not in kinds
    sampler = next(key for key, node in workflow.items() if node["class_type"] == "KSampler")
    steps = workflow[sampler]["inputs"]["steps"]
    ticks = [m["data"]["value"] for m in messages if m["type"] == "progress" and m["data"]["node"] == sampler]
    assert ticks[-1] == steps  # the sampler's progress bar ran to its end
    outputs = {m["data"]["node"]: m["data"]["output"]["images"] for m in messages if m["type"] == "executed"}
    saves = {key: node["inputs"]["filename_prefix"] for key, node in workflow.items() if node["class_type"] == "SaveImage"}
    assert set(outputs) == set(saves)
    for key, (image,) in outputs.items():
        assert image["filename"].startswith(saves[key]) and (server.output_dir / image["filename"]).is_file()
    return [image["filename"] for (image,) in outputs.values()]


def test_queued_prompts_all_finish_in_order_with_their_own_images(client, server, sdxl_checkpoint):
    prompts = batch(sdxl_checkpoint)
    with client.events() as events:
        accepted, refused = queue_all(client, prompts)
        messages = events.follow(list(accepted.values()))
        started = [m["data"]["prompt_id"] for m in events.messages if m["type"] == "execution_start"]
    assert list(refused) == ["invalid mode"] and "fastest" in refused["invalid mode"]
    assert started == list(accepted.values())  # one after the other, in the order queued; none lost
    files = []
    for label, workflow, expected in prompts:
        if label in accepted:
            history = client.get(f"/history/{accepted[label]}")[accepted[label]]
            assert history["status"]["status_str"] == {"image": "success", "error": "error"}[expected], label
        if expected == "image":
            files += images_of(workflow, messages[accepted[label]], server)
        elif expected == "error":
            (error,) = [m["data"] for m in messages[accepted[label]] if m["type"] == "execution_error"]
            assert error["node_type"] == "OverdriveSwitchWeights" and "architecture" in error["exception_message"]
    assert len(set(files)) == 5  # 1 + 1 + 2 (the two checkpoints' weights) + 1, each image its own file
