"""Overdrive's nodes called on ComfyUI's real ModelPatcher and sampler, in-process on the CPU."""
import logging
import shutil
import threading
import time

import pytest
import torch

from overdrive.compiler import CompiledMethod, dynamo_graph_count
from overdrive.harness.inprocess import build_model, conditioning, save_unet_checkpoint
from overdrive.harness.iteration_soak import live_tensor_bytes

RES = 64  # pixels: an 8x8 latent keeps CPU compiles short
TOLERANCE = 1e-3  # relative error of compiled vs eager latents (float32 on CPU; measured ~1e-5)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODES
    return NODES


@pytest.fixture(scope="module")
def base(comfy):
    return build_model(comfy, "sd15", "tiny", torch.float32, seed=0)


@pytest.fixture(scope="module")
def sample(comfy):
    import comfy.sample

    positive, negative = conditioning("sd15", RES, RES, seed=1)
    latent = torch.zeros(1, 4, RES // 8, RES // 8)
    noise = comfy.sample.prepare_noise(latent, 7)

    def run(model, steps=2):
        return comfy.sample.sample(model, noise, steps, 7.0, "euler", "normal", positive, negative, latent,
                                   seed=7, disable_pbar=True)
    return run


@pytest.fixture(scope="module")
def eager_latent(base, sample):
    return sample(base.clone())


@pytest.fixture(scope="module")
def compiled(nodes, base):
    return nodes["OverdriveCompileModel"].execute(base, mode="default", cuda_graphs=True, dynamic="auto")[0]


def test_compile_model_matches_eager_and_leaves_the_input_model_alone(base, compiled, sample, eager_latent):
    weights_before = {k: v.clone() for k, v in base.model.diffusion_model.state_dict().items()}
    patches_before = dict(base.object_patches)
    out = sample(compiled)
    assert relative_error(out, eager_latent) < TOLERANCE
    assert base.object_patches == patches_before and "diffusion_model.forward" in compiled.object_patches
    for k, v in base.model.diffusion_model.state_dict().items():
        assert torch.equal(v, weights_before[k])
    assert torch.equal(sample(base.clone()), eager_latent)  # the input MODEL still samples eager, unchanged
    # Loading the input MODEL unloaded the compiled clone and undid its object patch.
    assert not isinstance(base.model.diffusion_model.__dict__.get("forward"), CompiledMethod)


def test_letting_go_of_a_dropped_models_forward_leaves_a_collected_module_alone(comfy):
    """The finalizer that drops Overdrive's forward from a dropped model's module runs at /free after the module is
    gone too: it has nothing to do then (it raised AttributeError from inside the garbage collector)."""
    import weakref
    from overdrive.comfy_host.forward_patch import _drop_forward
    module = torch.nn.Linear(2, 2)
    module.forward = module.forward  # the module's own bound method, as an unpatch leaves it
    ref = weakref.ref(module)
    _drop_forward(ref)
    assert "forward" not in module.__dict__
    del module
    _drop_forward(ref)  # collected: returns without raising


@pytest.fixture
def comfy_progress_hook(comfy):
    """ComfyUI's progress hook as its server installs it: each update first raises a pending stop request."""
    import comfy.utils
    previous = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(
        lambda *args, **kwargs: comfy.model_management.throw_exception_if_processing_interrupted())
    yield
    comfy.utils.set_progress_bar_global_hook(previous)
    comfy.model_management.interrupt_current_processing(False)


def test_a_stop_lost_in_a_weakref_callback_is_raised_again(comfy, comfy_progress_hook, monkeypatch):
    """Python prints and drops an exception raised in a weakref callback or `__del__`, where the garbage collector
    runs them inside the compiler: a body still running after its stop was raised gets it again. Here the body drops
    the first one itself."""
    from comfy.model_management import InterruptProcessingException, interrupt_current_processing
    from overdrive.comfy_host import progress
    monkeypatch.setattr(progress._StopInjector, "AGAIN_AFTER_S", 0.5)
    caught, start = [], time.perf_counter()
    threading.Timer(0.3, interrupt_current_processing, args=(True,)).start()
    with pytest.raises(InterruptProcessingException):
        with progress.comfy_progress("a body that drops the first stop", interval=0.1):
            while time.perf_counter() - start < 10:
                try:
                    while time.perf_counter() - start < 10:
                        time.sleep(0.01)
                except InterruptProcessingException:
                    if caught:
                        raise
                    caught.append(time.perf_counter() - start)  # dropped, as a weakref callback would
    assert len(caught) == 1 and time.perf_counter() - start < 3


def test_a_stop_while_compiling_ends_the_run_as_interrupted_and_keeps_the_model_compiled(
        comfy, nodes, base, sample, eager_latent, comfy_progress_hook, caplog):
    """A stop sent while a graph compiles ends the compile there (a cold DiT block compiles for tens of seconds on a
    GPU; the stop used to wait for it): the prompt ends interrupted, nothing counts as a compile failure (that meant
    eager until a restart), and the next prompt compiles the graph from the start and matches eager. (The progress
    heartbeat thread once raised, and so cleared, the stop itself: the prompt finished as if nothing happened.)"""
    from comfy.model_management import InterruptProcessingException, interrupt_current_processing, processing_interrupted

    # Options no other test compiles with: this run really compiles (several seconds on the CPU).
    model = nodes["OverdriveCompileModel"].execute(base, mode="default", cuda_graphs=False, dynamic="static",
                                                     regional=False)[0]
    stop = threading.Timer(1.5, interrupt_current_processing, args=(True,))  # POST /interrupt, mid-compile
    stop.start()
    graphs = dynamo_graph_count()
    with caplog.at_level(logging.INFO, logger="overdrive"), pytest.raises(InterruptProcessingException):
        sample(model)
    stop.join()
    assert not processing_interrupted()  # the stop was delivered (and consumed) in the sampling thread
    assert "stopped in" in caplog.text and "finished in" not in caplog.text, caplog.text  # cut short mid-compile
    forward = model.object_patches["diffusion_model.forward"]
    assert forward.graph.failure is None and "runs eager" not in caplog.text
    # No compiled graph came out of the stopped compile. (Dynamo counts a graph once it is traced, before Inductor
    # compiles it: where the stop lands after the trace, that count has moved; the entry point's has not.)
    assert forward.graph.graphs_compiled == 0
    assert relative_error(sample(model), eager_latent) < TOLERANCE  # the next prompt compiles and runs compiled
    assert dynamo_graph_count() > graphs and forward.graph.graphs_compiled > 0 and forward.graph.failure is None


def test_lora_on_a_compiled_model_applies_without_recompiling(base, compiled, sample):
    sample(compiled)  # compiled and warm
    graphs = dynamo_graph_count()
    key = "diffusion_model.input_blocks.0.0.weight"
    weight = base.model.diffusion_model.input_blocks[0][0].weight
    diff = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.05
    with_lora, eager_lora = compiled.clone(), base.clone()
    for m in (with_lora, eager_lora):
        m.add_patches({key: (diff,)}, 1.0)  # a real ComfyUI weight patch ("diff"), as LoRA loaders add them
    out, expected = sample(with_lora), sample(eager_lora)
    assert relative_error(out, expected) < TOLERANCE
    assert relative_error(out, sample(compiled)) > 1e-4  # the patch changed the result
    assert dynamo_graph_count() == graphs


def test_precompile_runs_a_saved_frame_and_leaves_patched_calls_to_torch_compile(nodes, base, sample, eager_latent,
                                                                                caplog):
    """CompileModel(precompile=True) on ComfyUI's real sampler: the first shape's call is precompiled (whole graph,
    no Dynamo guards) and saved; a LoRA's weights go through it; a call carrying an attention patch (a function,
    which the frame's own check cannot key) runs through torch.compile with its guards, and stays right."""
    with caplog.at_level(logging.INFO, logger="overdrive.compiler"):
        precompiled = nodes["OverdriveCompileModel"].execute(base, cuda_graphs=False, precompile=True)[0]
        out = sample(precompiled)
    assert relative_error(out, eager_latent) < TOLERANCE
    assert "precompiled forward" in caplog.text
    graph = precompiled.object_patches["diffusion_model.forward"].graph
    assert graph.frames is not None and graph.frames.frames and graph.frames.failure is None
    folder = precompiled.object_patches["diffusion_model.forward"].disk.directory  # ComfyUI's models folder
    assert list(folder.glob("*.frames/*.bin")), "the frame was not saved"

    key = "diffusion_model.input_blocks.0.0.weight"
    diff = torch.randn(base.model.diffusion_model.input_blocks[0][0].weight.shape,
                       generator=torch.Generator().manual_seed(4)) * 0.05
    with_lora, eager_lora = precompiled.clone(), base.clone()
    for m in (with_lora, eager_lora):
        m.add_patches({key: (diff,)}, 1.0)
    assert relative_error(sample(with_lora), sample(eager_lora)) < TOLERANCE

    def scale_queries(q, k, v, extra_options):
        return q * 1.5, k, v
    with_patch, eager_patch = precompiled.clone(), base.clone()
    for m in (with_patch, eager_patch):
        m.set_model_attn1_patch(scale_queries)
    patched, expected = sample(with_patch), sample(eager_patch)
    assert relative_error(patched, expected) < TOLERANCE
    assert relative_error(patched, eager_latent) > 1e-3  # the patch mattered, and was not skipped


@pytest.fixture(scope="module")
def controlnet(comfy, base, tmp_path_factory):
    """A ControlNet of the tiny SD1.5 UNet's shape with fixed-seed weights (its zero convolutions too, so its residuals
    are not zero), saved in the original layout and loaded by ComfyUI as its ControlNet loader loads a file."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops
    from safetensors.torch import save_file

    config = {k: v for k, v in base.model.model_config.unet_config.items() if k not in ("out_channels", "dtype")}
    net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                                     device="cpu", **config)
    generator = torch.Generator().manual_seed(5)
    weights = {f"control_model.{k}": torch.randn(v.shape, generator=generator) * 0.05
               for k, v in net.state_dict().items()}
    path = tmp_path_factory.mktemp("controlnet") / "tiny-sd15-controlnet.safetensors"
    save_file(weights, str(path))
    return comfy.controlnet.load_controlnet(str(path))


def test_a_controlnet_guides_the_compiled_model_and_the_step_cache_as_it_guides_eager(comfy, nodes, base, compiled,
                                                                                      controlnet, eager_latent,
                                                                                      caplog):
    """ControlNet Apply (Advanced) on the prompt: Compile Model samples what eager samples with the same control; the
    step cache runs each step that carries ControlNet residuals in full, and says so."""
    import comfy.sample
    from nodes import ControlNetApplyAdvanced

    hint = torch.rand(1, RES, RES, 3, generator=torch.Generator().manual_seed(6))  # the control image, pixels
    positive, negative = ControlNetApplyAdvanced().apply_controlnet(*conditioning("sd15", RES, RES, seed=1), controlnet,
                                                                   hint, 1.0, 0.0, 1.0)
    latent = torch.zeros(1, 4, RES // 8, RES // 8)

    def sample_controlled(model):
        return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 2, 7.0, "euler", "normal", positive,
                                   negative, latent, seed=7, disable_pbar=True)
    expected = sample_controlled(base.clone())
    assert relative_error(expected, eager_latent) > 1e-3  # the control changed the image
    assert relative_error(sample_controlled(compiled), expected) < TOLERANCE
    cached = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
    with caplog.at_level(logging.INFO, logger="overdrive"):
        out = sample_controlled(cached)
    assert "ControlNet" in caplog.text, caplog.text[-2000:]
    assert relative_error(out, expected) < TOLERANCE  # no step reused


def test_unloading_a_precompiled_model_releases_its_frames_which_load_again_from_disk(comfy, nodes, base, sample,
                                                                                      eager_latent, caplog):
    model = nodes["OverdriveCompileModel"].execute(base, cuda_graphs=False, precompile=True)[0]
    first = sample(model)
    frames = model.object_patches["diffusion_model.forward"].graph.frames
    assert frames.frames  # held in memory after the run
    comfy.model_management.load_models_gpu([model])  # ComfyUI's per-run detach (no unpatching) keeps them
    assert frames.frames
    comfy.model_management.unload_all_models()
    assert not frames.frames
    with caplog.at_level(logging.INFO, logger="overdrive"):
        again = sample(model)
    assert "loaded the precompiled frame" in caplog.text
    assert torch.equal(again, first) and relative_error(again, eager_latent) < TOLERANCE


@pytest.fixture(scope="module")
def checkpoints(comfy, tmp_path_factory):
    """Two SD1.5-shaped checkpoints (other seeds) and one SDXL-shaped, in a folder ComfyUI searches (1.1 GB, removed
    when this module ends)."""
    import folder_paths

    folder = tmp_path_factory.mktemp("checkpoints")
    for name, arch, seed in (("sd15-seed1.safetensors", "sd15", 1), ("sd15-seed2.safetensors", "sd15", 2),
                             ("sdxl-seed0.safetensors", "sdxl", 0)):
        model = build_model(comfy, arch, "tiny", torch.float16, seed=seed)
        save_unet_checkpoint(model, folder / name)
        del model
    folder_paths.add_model_folder_path("checkpoints", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_switch_weights_reuses_the_compiled_graph_and_matches_eager(comfy, nodes, compiled, sample, checkpoints):
    sample(compiled)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchWeights"].execute(compiled, "sd15-seed1.safetensors")[0]
    out = sample(switched)
    assert dynamo_graph_count() == graphs  # no recompile
    reference = build_model(comfy, "sd15", "tiny", torch.float32, seed=1)
    # The file holds fp16 weights; the running model is float32, and the switch keeps float32.
    assert {p.dtype for p in switched.model.diffusion_model.parameters()} == {torch.float32}
    with torch.no_grad():
        for p in reference.model.diffusion_model.parameters():
            p.copy_(p.half().float())
    assert relative_error(out, sample(reference)) < TOLERANCE


def test_switch_weights_refuses_another_architecture_and_changes_nothing(nodes, compiled, sample, checkpoints):
    before = sample(compiled)
    patches = dict(compiled.object_patches)
    from overdrive.compiler import WeightMismatchError
    with pytest.raises(WeightMismatchError, match="does not match the running model's architecture.*missing keys"):
        nodes["OverdriveSwitchWeights"].execute(compiled, "sdxl-seed0.safetensors")
    assert compiled.object_patches == patches
    assert torch.equal(sample(compiled), before)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "truncated-ckpt"])
def test_switch_weights_names_a_damaged_file_and_changes_nothing(nodes, compiled, sample, checkpoints, damage):
    from overdrive.compiler import WeightMismatchError
    data = (checkpoints / "sd15-seed1.safetensors").read_bytes()
    name = f"damaged-{damage}.{'ckpt' if damage.endswith('ckpt') else 'safetensors'}"
    content = {"truncated": data[: len(data) // 2], "garbage": b"\xff" * 4096, "empty": b"",
               "truncated-ckpt": data[: len(data) // 3]}[damage]
    (checkpoints / name).write_bytes(content)
    before, patches = sample(compiled), dict(compiled.object_patches)
    with pytest.raises(WeightMismatchError, match=f"{name} could not be read .*Download or copy it again. The running "
                                                  f"model was left unchanged"):
        nodes["OverdriveSwitchWeights"].execute(compiled, name)
    assert compiled.object_patches == patches
    assert torch.equal(sample(compiled), before)


def test_switch_weights_names_the_layers_of_a_file_with_nan_or_inf_and_switches_all_the_same(nodes, base, tmp_path,
                                                                                           caplog):
    """A file whose weights hold NaN or Inf (a broken merge or conversion) is the user's: it is switched to as asked,
    with one warning naming the layers."""
    import folder_paths
    from safetensors.torch import load_file, save_file
    from overdrive.builtin_models import ensure_checkpoint

    state = load_file(str(ensure_checkpoint("sd15", "tiny", seed=1)))
    poisoned = {"input_blocks.0.0.weight": float("nan"), "middle_block.1.proj_in.weight": float("-inf"),
                "out.2.bias": float("inf")}
    for key, value in poisoned.items():
        state[f"model.diffusion_model.{key}"].view(-1)[:3] = value
    save_file(state, str(tmp_path / "sd15-poisoned.safetensors"))
    folder_paths.add_model_folder_path("checkpoints", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        switched = nodes["OverdriveSwitchWeights"].execute(base, "sd15-poisoned.safetensors")[0]
    (warning,) = [record.getMessage() for record in caplog.records if "NaN or Inf" in record.getMessage()]
    assert warning.startswith("Overdrive: 3 of the ") and all(key in warning for key in poisoned), warning
    assert switched.model.diffusion_model.input_blocks[0][0].weight.isnan().any()  # switched all the same


def test_switched_model_loads_its_own_weights_and_gives_the_original_back(nodes, compiled, sample, checkpoints):
    # ComfyUI's loader keeps "same weights" clones loaded as they are; a switch must not be mistaken for one.
    before = sample(compiled)
    switched = nodes["OverdriveSwitchWeights"].execute(compiled, "sd15-seed1.safetensors")[0]
    assert switched.model is not compiled.model and not switched.is_clone(compiled)
    # ComfyUI's clones share the loader's records of what a load changed on their model (backups, pinned weights):
    # the switched model has its own, or unloading it would restore or unpin the original's tensors.
    for records in ("backup", "backup_buffers", "object_patches_backup", "pinned"):
        assert getattr(switched, records) is not getattr(compiled, records), records
    after = sample(switched)
    assert relative_error(after, before) > 1e-3
    assert torch.equal(sample(compiled), before)  # back to the original, and its weights are where they were


def test_a_switched_model_counts_as_not_loaded_so_comfyui_makes_room_for_it(comfy, nodes, compiled, sample,
                                                                          checkpoints):
    """The switched weights are fresh tensors off the GPU: ComfyUI's own memory accounting must see all of them as
    still to load (else it unloads nothing for them; an SDXL GPU run went out of memory after six switches). On the
    CPU every device is the CPU, so the source model is marked loaded on a GPU here, as ComfyUI's loader marks it."""
    import comfy.model_management as mm

    sample(compiled)
    gpu = torch.device("cuda", 0)
    holder, attr = compiled.model, "device"
    before = getattr(holder, attr)
    setattr(holder, attr, gpu)
    try:
        assert mm.LoadedModel(compiled).model_memory_required(gpu) < compiled.model_size()  # the premise: "loaded"
        switched = nodes["OverdriveSwitchWeights"].execute(compiled, "sd15-seed1.safetensors")[0]
        assert mm.LoadedModel(switched).model_memory_required(gpu) >= switched.model_size()
    finally:
        setattr(holder, attr, before)


def test_switching_while_another_prompt_samples_never_mixes_weights(nodes, compiled, sample, checkpoints):
    expected = sample(compiled)
    results, errors = [], []

    def keep_sampling():
        try:
            for _ in range(3):
                results.append(sample(compiled))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=keep_sampling)
    thread.start()
    for name in ["sd15-seed1.safetensors", "sd15-seed2.safetensors"] * 2:
        nodes["OverdriveSwitchWeights"].execute(compiled, name)
    thread.join()
    assert not errors and len(results) == 3
    for out in results:
        assert torch.equal(out, expected)


def test_repeated_switches_do_not_grow_memory(nodes, compiled, checkpoints):
    import psutil

    switcher = nodes["OverdriveSwitchWeights"]
    live, rss = [], []
    for i in range(8):  # a leak of one set of weights per switch would show four times over after the fourth
        out = switcher.execute(compiled, f"sd15-seed{1 + i % 2}.safetensors")[0]
        del out
        live.append(live_tensor_bytes())
        rss.append(psutil.Process().memory_info().rss)
    model_bytes = sum(p.numel() * p.element_size() for p in compiled.model.diffusion_model.parameters())
    # After the first switches (loaded file buffers, the twin's first allocation), nothing more may stay alive.
    assert max(live[4:]) - live[4] < model_bytes * 0.05, ([b / 2**20 for b in live], [r / 2**20 for r in rss])


def test_compile_vae_decodes_like_eager(comfy, nodes):
    import comfy.sd
    from overdrive.harness.inprocess import build_vae

    vae = build_vae(comfy, seed=0)
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    expected = vae.decode(latent)
    compiled_vae = nodes["OverdriveCompileVAE"].execute(vae, mode="default", cuda_graphs=True, dynamic="auto", compile_encoder=False)[0]
    out = compiled_vae.decode(latent)
    assert relative_error(out, expected) < TOLERANCE
    assert torch.equal(vae.decode(latent), expected)
    assert not isinstance(vae.first_stage_model.__dict__.get("decode"), CompiledMethod)
