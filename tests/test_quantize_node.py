"""Quantize Model (Overdrive) on ComfyUI's real ModelPatcher, sampler and LoRA loader, in-process on the CPU (int8
through torch._int_mm), plus one workflow queued through a real ComfyUI server."""
import logging
import math

import pytest
import torch

from overdrive.compiler.block_graphs import _BlockWeights as WeightsOfBlock
from overdrive.quantization import Int8Linear, QuantConv2d1x1
from overdrive.harness.inprocess import build_model, conditioning
from overdrive.harness.workflows import load_workflow, set_inputs, without_overdrive
from test_dit_families import record_calls  # the per-call recorder the DiT family tests use

RES = 64  # pixels: an 8x8 latent keeps CPU sampling and compiling short
STEPS, CFG = 2, 1.0  # cfg 1: the comparisons measure quantization, not cfg's 7x amplification of a random model
# Relative error of the final latent, int8 vs float (all 99 eligible layers quantized; measured ~0.02).
TOLERANCE = 0.05
PER_CALL_TOLERANCE = 0.05  # one model call, int8 against float (measured 2.5 %)
EVERYTHING = dict(conv_mse_threshold=1e9, linear_mse_threshold=1e9, compute_density_threshold=0.0)
QUANTIZED_TYPES = (Int8Linear, QuantConv2d1x1)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """Decisions of this module's runs only (the node reads OVERDRIVE_CACHE_DIR at each run)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OVERDRIVE_CACHE_DIR", str(tmp_path_factory.mktemp("overdrive-cache")))
        yield


@pytest.fixture(scope="module")
def node(comfy):
    from overdrive.nodes import NODES
    return NODES["OverdriveQuantizeModel"]


@pytest.fixture(scope="module")
def base(comfy):
    return build_model(comfy, "sd15", "tiny", torch.float32, seed=0)


@pytest.fixture(scope="module")
def float_layers(base):
    """{name: (weight shape, stride)} of the float Linear/Conv2d layers, read before any other clone is loaded (a
    loaded quantized clone's object patches replace some of them in the shared module tree)."""
    return {name: (tuple(m.weight.shape), getattr(m, "stride", None))
            for name, m in base.model.diffusion_model.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


@pytest.fixture(scope="module")
def prompt():
    positive, negative = conditioning("sd15", RES, RES, seed=1)
    return dict(positive=positive, negative=negative, latent={"samples": torch.zeros(1, 4, RES // 8, RES // 8)})


@pytest.fixture(scope="module")
def sample(comfy, prompt):
    import comfy.sample

    latent = prompt["latent"]["samples"]
    noise = comfy.sample.prepare_noise(latent, 7)

    def run(model):
        with torch.inference_mode():  # as ComfyUI samples
            return comfy.sample.sample(model, noise, STEPS, CFG, "euler", "normal", prompt["positive"],
                                       prompt["negative"], latent, seed=7, disable_pbar=True)
    return run


def quantize(node, model, prompt, **settings):
    """Run the node as ComfyUI does (in inference mode); returns (patched MODEL, report)."""
    from overdrive.comfy_host.quantized_model import quantization_report

    with torch.inference_mode():
        (patched,) = node.execute(model, calibration_steps=2, **{**prompt, **settings})
    return patched, quantization_report(patched)


def quantized_names(model):
    from overdrive.comfy_host.quantized_state import quantized_modules
    return set(quantized_modules(model))


def eligible(float_layers, kinds=("linear", "conv")):
    """Layers with an 8-bit kernel: every Linear, and 1x1 convs with stride 1 (these models have no others)."""
    names = set()
    for name, (shape, stride) in float_layers.items():
        if len(shape) == 2 and "linear" in kinds:
            names.add(name)
        elif len(shape) == 4 and shape[2:] == (1, 1) and stride == (1, 1) and "conv" in kinds:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def float_latent(base, sample):
    return sample(base.clone())


@pytest.fixture(scope="module")
def progress_updates(comfy):
    import comfy.utils
    updates = []
    previous = comfy.utils.PROGRESS_BAR_HOOK
    # ComfyUI also passes node_id=
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview=None, **_: updates.append((value, total)))
    yield updates
    comfy.utils.set_progress_bar_global_hook(previous)


@pytest.fixture(scope="module")
def quantized(comfy, node, base, float_layers, prompt, float_latent, progress_updates):
    """Every eligible layer quantized (huge error thresholds, no density limit), with the input MODEL's state just
    before and just after the node."""
    comfy.model_management.load_models_gpu([base.clone()])  # the input MODEL's own layers and weights in the tree
    before = snapshot(base)
    patched, report = quantize(node, base, prompt, **EVERYTHING)
    return dict(model=patched, report=report, progress=list(progress_updates), before=before, after=snapshot(base))


@pytest.fixture(scope="module")
def quantized_latent(quantized, sample):
    return sample(quantized["model"])


def snapshot(model):
    from overdrive.quantization import weights_digest
    tree = model.model.diffusion_model
    return dict(ids={name: id(m) for name, m in tree.named_modules()}, object_patches=dict(model.object_patches),
                patches={k: list(v) for k, v in model.patches.items()},
                options=repr(model.model_options), weights=weights_digest(tree))


def quantized_layers(model):
    """{name: 8-bit layer} that `model` runs (the layer itself where a LoRA side path holds it)."""
    from overdrive.comfy_host.quantized_state import quantized_modules
    return dict(sorted(quantized_modules(model).items()))


# -------------------------------------------------------------------------------------------- what is quantized
def test_huge_thresholds_quantize_every_eligible_layer_within_tolerance(quantized, quantized_latent, base,
                                                                        float_layers, float_latent):
    report = quantized["report"]
    assert report.calibrated and not report.cache_hit
    assert quantized_names(quantized["model"]) == set(report.quantized) == eligible(float_layers)
    assert torch.isfinite(quantized_latent).all()
    assert 0 < relative_error(quantized_latent, float_latent) < TOLERANCE
    assert (2, 2) in quantized["progress"]  # the calibration's steps ticked ComfyUI's progress bar (2 of 2)


def test_zero_thresholds_quantize_nothing(node, base, prompt, sample, float_latent):
    patched, report = quantize(node, base, prompt, conv_mse_threshold=0.0, linear_mse_threshold=0.0,
                               compute_density_threshold=0.0)
    assert report.calibrated and report.quantized == [] and quantized_names(patched) == set()
    assert torch.equal(sample(patched), float_latent)


@pytest.mark.parametrize("switch, kept", [("quantize_conv", "linear"), ("quantize_linear", "conv")])
def test_switching_a_layer_kind_off_leaves_those_layers_alone(node, base, prompt, float_layers, switch, kept):
    patched, report = quantize(node, base, prompt, **EVERYTHING, **{switch: False})
    assert quantized_names(patched) == eligible(float_layers, kinds=(kept,))
    off = "conv" if kept == "linear" else "linear"
    assert all(f"{off} quantization off" in report[name].reason for name in eligible(float_layers, (off,)))


def test_the_input_model_is_never_changed(comfy, quantized, quantized_latent, base, sample, float_latent):
    assert quantized["after"] == quantized["before"]  # the node changed nothing of the input MODEL
    # The quantized clone has been sampled. Loaded (as sampling it does), its object patches hold the 8-bit layers
    # in the shared module tree ...
    comfy.model_management.load_models_gpu([quantized["model"]])
    tree = base.model.diffusion_model
    assert all(isinstance(tree.get_submodule(name), QUANTIZED_TYPES) for name in quantized_names(quantized["model"]))
    # ... and loading the input MODEL puts its own float layers back: same modules, same weights, same result.
    assert torch.equal(sample(base.clone()), float_latent)
    assert snapshot(base) == quantized["before"]


@pytest.fixture
def new_process(monkeypatch):
    """No quantized layers alive from earlier runs, as in a new process (the disk cache stays)."""
    import weakref
    from overdrive.comfy_host import quantized_sets
    monkeypatch.setattr(quantized_sets, "_LIVE", weakref.WeakValueDictionary())


def runs_of(model):
    """A list that grows by one at each call of `model`'s diffusion model (a calibration or a load would call it)."""
    calls = []
    return calls, model.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))


def test_a_second_run_with_the_same_weights_and_settings_takes_the_same_layers(quantized, node, base, prompt):
    """A LoRA, a prompt or a seed changes Quantize Model's inputs, so ComfyUI runs it again on the same model: it takes
    the layers it made before (no calibration, no quantizing, no second copy in memory)."""
    calls, hook = runs_of(base)
    try:
        again, report = quantize(node, base, {**prompt, "positive": prompt["negative"]}, **EVERYTHING)
    finally:
        hook.remove()
    assert calls == [] and report is quantized["report"]
    first = quantized_layers(quantized["model"])
    assert all(layer is first[name] for name, layer in quantized_layers(again).items())


def test_a_new_process_takes_the_cached_decisions_without_calibrating(quantized, node, base, prompt, new_process):
    """After a restart the layers are gone with the process; the decisions on disk give the same layers again."""
    calls, hook = runs_of(base)
    try:
        again, report = quantize(node, base, prompt, **EVERYTHING)
    finally:
        hook.remove()
    first = quantized["report"]
    assert report.cache_hit and not report.calibrated and len(calls) == 0  # loaded, but no sampling pass ran
    assert report.quantized == first.quantized and report.cache_key == first.cache_key
    cached, fresh = quantized_layers(again), quantized_layers(quantized["model"])
    assert cached.keys() == fresh.keys()
    for name, module in cached.items():  # layers of its own, holding the same 8-bit weights
        assert module is not fresh[name]
        expected = fresh[name].state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(value, expected[key]), f"{name}.{key}"


def test_quantized_layers_follow_the_model_between_devices(quantized, node, base, prompt, new_process):
    from overdrive.comfy_host import quantize_patches
    again, _ = quantize(node, base, prompt, **EVERYTHING)
    layers = list(quantized_layers(again).values())
    again.model_patches_to(torch.float16)  # ComfyUI also passes the model dtype: the 8-bit storage keeps its dtype
    assert {b.dtype for m in layers for b in m.buffers()} == {torch.int8, torch.float32}
    again.model_patches_to(torch.device("meta"))  # as ComfyUI calls it on load
    assert {b.device.type for m in layers for b in m.buffers()} == {"meta"}
    quantize_patches.followers(again)[0].modules = {}  # meta tensors cannot move back when `again` is collected


def test_the_resident_size_counts_quantized_layers_at_their_8_bit_size(quantized, base):
    """Compile Model decides from it whether a model fits the card whole (comfy_host/dynamic_vram.py): the float size
    would keep a quantized Flux, which fits a 16 GiB card, on the streaming path."""
    from overdrive.comfy_host.quantized_state import quantized_modules, resident_bytes
    from overdrive.comfy_host.quantized_streaming import tensor_bytes
    model = quantized["model"]
    layers = quantized_modules(model)
    tree = base.model.diffusion_model
    float_bytes = sum(tensor_bytes(tree.get_submodule(name)) for name in layers)
    eight_bit = sum(tensor_bytes(module) for module in layers.values())
    assert eight_bit < 0.5 * float_bytes  # int8 from float32 weights (the scales, biases and static scales beside)
    assert resident_bytes(model) == base.model_size() - float_bytes + eight_bit
    assert resident_bytes(base) == base.model_size()
    # ComfyUI sizes its loads by model_size(): told the float size, it loads a model that fits partially (tensors of
    # the blocks themselves left in host memory, compiled blocks kept off CUDA graphs)
    assert model.model_size() == resident_bytes(model)
    from overdrive.comfy_host.quantize_patches import retarget
    again = model.clone()
    assert retarget(again) == len(layers) and again.model_size() == resident_bytes(again) == resident_bytes(model)


class Moves(list):
    """The moves the device follower makes, as (which layers, device type), tracked instead of made."""

    def __init__(self):
        super().__init__()
        self.where = {}  # module id -> device type it would be on

    def devices(self, follower) -> tuple:
        """(where the 8-bit layer would be, where the float layer would be) of a one-layer follower."""
        return tuple(self.where[id(module)] for module in (follower.modules["layer"], follower.originals["layer"]))

    def device_of(self, module) -> torch.device:
        return torch.device(self.where.get(id(module), next(iter(module.state_dict().values())).device.type))

    def place(self, modules, device):
        self.where.update({id(m): device for m in modules})

    def __call__(self, modules, device):
        modules, device = list(modules), torch.device(device).type
        moving = [m for m in modules if self.device_of(m).type != device]
        if moving:
            self.append(("8-bit" if hasattr(moving[0], "load_float_weight") else "float", device))
            self.place(moving, device)


@pytest.fixture
def moves(monkeypatch):
    """On a CPU-only machine there is no second device to see moves on (tests/test_quantize_memory_gpu.py moves for
    real): the meta device stands for the GPU, and moves are tracked instead of made."""
    from overdrive.comfy_host import quantized_follower
    tracked = Moves()
    monkeypatch.setattr(quantized_follower, "move", tracked)
    monkeypatch.setattr(quantized_follower, "on_device", tracked.device_of)
    return tracked


def follower_for(layers, originals, load, offload, tree=None):
    """Quantize Model's follower of `layers` ({name: 8-bit layer}) standing in for `originals` (float layers)."""
    from overdrive.comfy_host.quantized_follower import QuantizedModules
    from overdrive.comfy_host.quantized_lora import SidePaths
    from overdrive.comfy_host.quantized_sets import QuantizedSet
    quantized = QuantizedSet(layers, None, SidePaths(layers, torch.float32))
    return QuantizedModules(quantized, layers, originals, torch.device(load), torch.device(offload), tree)


def follower_of_one_layer(load, offload):
    return follower_for({"layer": Int8Linear.from_float(torch.nn.Linear(32, 32))}, {"layer": torch.nn.Linear(32, 32)},
                        load, offload)


def test_loading_a_quantized_model_sends_the_float_layers_it_replaced_off_the_gpu(quantized, moves):
    from overdrive.comfy_host import quantize_patches
    model = quantized["model"]
    follower = quantize_patches.followers(model)[0]
    assert set(follower.originals) == set(quantized_layers(model))
    assert all(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in follower.originals.values())
    assert (follower.load_device, follower.offload_device) == (model.load_device, model.offload_device)
    # The meta device stands for the GPU. ComfyUI's default offloads to the CPU; --gpu-only and --highvram to the GPU.
    for offload in ("cpu", "meta"):
        follower = follower_of_one_layer("meta", offload)
        moves.place(follower.originals.values(), "meta")  # the float model was loaded on the GPU
        moves.clear()
        follower.to(torch.float16)  # a dtype: nothing moves
        follower.to(torch.device("meta"))  # loaded: the float layers to the CPU first, then the 8-bit ones in
        assert moves == [("float", "cpu"), ("8-bit", "meta")]  # never both on the card
        if offload == "cpu":
            follower.to(torch.device("cpu"))  # a clone detaches: on_detach decides, not this call
            assert len(moves) == 2


def test_comfyui_detaching_a_model_it_keeps_loaded_moves_nothing(comfy, quantized, moves):
    """ComfyUI 0.7 detaches (without unpatching) a loaded model before each of its sampling runs, and any clone it
    collects: moving the layers each time cost Flux's fp8 model 22 GB of copies per image."""
    import gc
    from overdrive.comfy_host import quantize_patches
    follower = follower_of_one_layer("meta", "cpu")
    parent = quantized["model"].clone()
    parent.set_model_patch(follower, quantize_patches.FOLLOWER)
    parent.add_callback(quantize_patches.CallbacksMP.ON_DETACH, follower.on_detach)
    child = parent.clone()  # shares the follower, as every clone does
    comfy.model_management.load_models_gpu([child])
    moves.place(follower.originals.values(), "meta")  # the float layers were loaded on the GPU ...
    follower.to(torch.device("meta"))  # ... until the quantized model loaded there
    moves.clear()
    comfy.model_management.load_models_gpu([child])  # the next run: ComfyUI detaches and reloads it
    del child
    gc.collect()
    assert moves == []
    comfy.model_management.unload_all_models()  # a real unload: the 8-bit layers go to the offload device
    assert moves.devices(follower)[0] == "cpu"


def test_a_float_clone_run_after_the_quantized_model_gets_its_float_layers_back_once(moves):
    """ComfyUI runs another clone of the checkpoint on the loaded weights without moving them; the float layers the
    quantized model sent to the CPU come back beside the input at the first call."""
    from collections import OrderedDict
    float_layer, eight_bit = torch.nn.Linear(32, 32), Int8Linear.from_float(torch.nn.Linear(32, 32))
    tree = torch.nn.Sequential(OrderedDict(layer=float_layer))
    follower = follower_for({"layer": eight_bit}, {"layer": float_layer}, "meta", "cpu", tree)
    moves.place([float_layer], "meta")
    follower.to(torch.device("meta"))  # the quantized model loads: its float layer to the CPU, a return hook set
    assert moves.devices(follower) == ("meta", "cpu") and follower.return_hook is not None
    hook = next(iter(tree._forward_pre_hooks.values()))  # called as the tree's forward would, on a "GPU" input
    tree.layer = eight_bit  # while the quantized model runs, the hook leaves everything alone
    hook(tree, (torch.zeros(1, 32, device="meta"),))
    assert moves.devices(follower) == ("meta", "cpu")
    tree.layer = float_layer  # the float model runs
    hook(tree, (torch.zeros(1, 32, device="meta"),))
    assert moves.devices(follower) == ("meta", "meta") and follower.return_hook is None
    assert not tree._forward_pre_hooks


def test_a_dropped_quantized_model_is_freed_though_its_return_hook_never_fired(comfy, moves):
    """The return hook sits on the checkpoint's module tree, which every clone shares: it must not keep a dropped
    quantized model's 8-bit layers alive until a float clone happens to run (on the H200, four Wan 2.2 fp8 models
    quantized in a row were all still alive), and must still bring the float layers back when one does."""
    import gc
    import weakref
    from collections import OrderedDict
    float_layer, eight_bit = torch.nn.Linear(32, 32), Int8Linear.from_float(torch.nn.Linear(32, 32))
    tree = torch.nn.Sequential(OrderedDict(layer=float_layer))
    follower = follower_for({"layer": eight_bit}, {"layer": float_layer}, "meta", "cpu", tree)
    moves.place([float_layer], "meta")  # ComfyUI had loaded it on the "GPU"
    follower.to(torch.device("meta"))
    assert len(tree._forward_pre_hooks) == 1
    dropped, layer = weakref.ref(follower), weakref.ref(eight_bit)
    del follower, eight_bit
    gc.collect()
    assert dropped() is None and layer() is None
    assert moves.where[id(float_layer)] == "cpu"
    tree(torch.zeros(1, 32))  # a float clone runs: its layers go back where ComfyUI had them, and the hook goes
    assert moves[-1] == ("float", "meta") and len(tree._forward_pre_hooks) == 0


def test_float_layers_comfyui_left_in_host_memory_stay_there_when_a_float_clone_runs(moves):
    """Under dynamic VRAM (or a partial load on a short card) ComfyUI keeps a layer's weights in host memory and
    streams them: a float clone run after the quantized model must not pull every float layer onto the GPU (at a
    16 GiB budget that ran Flux out of memory)."""
    from collections import OrderedDict
    streamed, resident = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    tree = torch.nn.Sequential(OrderedDict(streamed=streamed, resident=resident))
    eight_bit = {name: Int8Linear.from_float(torch.nn.Linear(32, 32)) for name in ("streamed", "resident")}
    follower = follower_for(eight_bit, {"streamed": streamed, "resident": resident}, "meta", "cpu", tree)
    moves.place([streamed], "cpu")
    moves.place([resident], "meta")
    follower.to(torch.device("meta"))
    assert (moves.where[id(streamed)], moves.where[id(resident)]) == ("cpu", "cpu")
    moves.clear()
    tree(torch.zeros(1, 32))
    assert moves == [("float", "meta")] and moves.where[id(streamed)] == "cpu"


# -------------------------------------------------------------------------------------------- LoRA
def lora_for(base, float_layers, names, seed=5, rank=4):
    """A LoRA file's tensors (kohya naming, as most LoRAs ship) for `names`, changing each weight by ~50%."""
    import comfy.utils
    to_diffusers = {v: k for k, v in comfy.utils.unet_to_diffusers(base.model.model_config.unet_config).items()}
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for name in names:
        (out_dim, in_dim, *kernel), _ = float_layers[name]
        key = "lora_unet_" + to_diffusers[name + ".weight"][:-len(".weight")].replace(".", "_")
        ones = [1] * len(kernel)
        lora[f"{key}.lora_up.weight"] = torch.randn(out_dim, rank, *ones, generator=generator) * 0.5 / rank ** 0.5
        lora[f"{key}.lora_down.weight"] = (torch.randn(rank, in_dim, *kernel, generator=generator)
                                           / (in_dim * math.prod(kernel)) ** 0.5)
        lora[f"{key}.alpha"] = torch.tensor(float(rank))
    return lora


LORA_LAYERS = ["input_blocks.1.1.proj_in", "input_blocks.1.1.transformer_blocks.0.attn1.to_q",
               "input_blocks.1.1.transformer_blocks.0.ff.net.2", "middle_block.1.transformer_blocks.0.attn2.to_v",
               "output_blocks.1.1.proj_out"]
CONV3X3 = "input_blocks.1.0.in_layers.2"


def with_lora(model, lora, strength=1.0):
    """`model` with `lora` (a LoRA file's tensors) at `strength`, as LoraLoaderModelOnly makes it."""
    import comfy.sd
    return comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]


def test_a_lora_before_quantize_runs_beside_the_same_quantized_layers(quantized, quantized_latent, node, base, prompt,
                                                                      float_layers, sample, float_latent):
    """The decisions and 8-bit layers are those of the weights without the LoRA (no calibration, no quantizing); the
    LoRA's patches stay on the model and run beside the layers at their own precision."""
    from overdrive.comfy_host.quantized_lora import side_paths_of
    lora = lora_for(base, float_layers, LORA_LAYERS + [CONV3X3])
    float_lora = with_lora(base, lora)
    calls, hook = runs_of(base)
    try:
        quantized_lora, report = quantize(node, float_lora, prompt, **EVERYTHING)
    finally:
        hook.remove()
    assert calls == [] and report is quantized["report"]
    assert set(quantized_lora.patches) == set(float_lora.patches)  # the 3x3 conv's for ComfyUI, the rest beside
    layers, paths = quantized_layers(quantized["model"]), side_paths_of(quantized_lora)
    assert set(paths) == set(layers) and all(paths[name].base is layers[name] for name in paths)
    # The LoRA moves the latent well beyond the quantization tolerance, so a quantized model that dropped it could not
    # pass the middle check.
    expected = sample(float_lora)
    assert relative_error(expected, float_latent) > 2 * TOLERANCE  # the LoRA matters ...
    out = sample(quantized_lora)
    assert relative_error(out, expected) < TOLERANCE  # ... and the quantized model honours it
    assert relative_error(out, quantized_latent) > 2 * TOLERANCE


def test_a_lora_strength_change_rewrites_only_the_strengths_beside_the_same_layers(quantized, node, base, prompt,
                                                                                  float_layers, sample, caplog):
    """LoraLoader keeps its file's tensors: another strength is another clone with the same factors, whose strengths
    alone are written into the same side paths at its sampling's start (no recompile, no re-quantization)."""
    from overdrive.comfy_host.quantized_lora import side_paths_of
    lora = lora_for(base, float_layers, LORA_LAYERS, seed=6)
    strong, weak = (quantize(node, with_lora(base, lora, strength), prompt, **EVERYTHING)[0] for strength in (1.0, 0.4))
    assert all(side_paths_of(strong)[name] is path for name, path in side_paths_of(weak).items())
    with caplog.at_level(logging.INFO, logger="overdrive.quantization"):
        assert relative_error(sample(weak), sample(with_lora(base, lora, 0.4))) < TOLERANCE
        caplog.clear()
        assert relative_error(sample(strong), sample(with_lora(base, lora, 1.0))) < TOLERANCE
    assert "LoRA strengths written" in caplog.text and "LoRA factors written" not in caplog.text


@pytest.mark.parametrize("conv", [False, True], ids=["beside-the-layers-only", "and-on-a-float-layer"])
def test_a_lora_strength_change_reloads_the_model_only_where_comfyui_patches_a_weight(quantized, node, base, prompt,
                                                                                      float_layers, sample, conv):
    """ComfyUI unpatches and reloads a model whose weight patches differ from the loaded ones (moving the whole tree,
    8-bit layers and all, to the host and back: every CUDA graph of its blocks was recorded again). Where a LoRA runs
    beside the quantized layers only, a strength change changes no weight ComfyUI patches: it reloads nothing. Where
    the LoRA also patches a float layer (the 3x3 conv), it must reload, and the new strength reaches that layer. The
    identity the clones share is the unpatched model's, as a quantized clone without a LoRA has it; Parallel Model's
    workers still tell the strengths apart."""
    from overdrive.comfy_host.parallel_calls import patch_key
    lora = lora_for(base, float_layers, LORA_LAYERS + ([CONV3X3] if conv else []), seed=8)
    strong, weak = (quantize(node, with_lora(base, lora, strength), prompt, **EVERYTHING)[0] for strength in (1.0, 0.4))
    assert (strong.patches_uuid == weak.patches_uuid == base.patches_uuid) != conv
    assert quantized["model"].patches_uuid == base.patches_uuid and patch_key(strong.patches) != patch_key(weak.patches)
    sample(strong)
    unpatched = []
    unpatch = type(weak).unpatch_model

    def watched(patcher, device_to=None, unpatch_weights=True):
        unpatched.append(unpatch_weights)
        return unpatch(patcher, device_to, unpatch_weights)
    type(weak).unpatch_model = watched
    try:
        out = sample(weak)
    finally:
        type(weak).unpatch_model = unpatch
    assert any(unpatched) == conv, unpatched
    assert relative_error(out, sample(with_lora(base, lora, 0.4))) < TOLERANCE


@pytest.mark.parametrize("unloaded", [True, False], ids=["quantized-model-unloaded", "quantized-model-loaded"])
def test_a_lora_model_run_after_a_quantized_model_gets_its_lora_on_every_layer(comfy, quantized, base, float_layers,
                                                                               sample, unloaded):
    """Two ways the last prompt's quantized model lost the next prompt's LoRA on exactly the quantized layers (the
    latent differed from the same LoRA on a fresh model by 0.29): LoraLoader checks keys against the shared module
    tree, which still held the 8-bit layers; and the float layers, out of the tree while ComfyUI unpatched it, came
    back marked "weights patched", so the next load skipped them."""
    lora = lora_for(base, float_layers, LORA_LAYERS)
    fresh = build_model(comfy, "sd15", "tiny", torch.float32, seed=0)  # the same weights, never quantized
    expected = sample(with_lora(fresh, lora))
    sample(quantized["model"])  # a prompt with the quantized model: ComfyUI keeps it loaded, 8-bit layers in place
    if unloaded:
        comfy.model_management.unload_all_models()
    out = sample(with_lora(base, lora))
    assert relative_error(out, expected) < 1e-5


def test_a_lora_after_quantize_runs_beside_the_quantized_layers_and_applies_elsewhere(quantized, quantized_latent,
                                                                                    base, float_layers, sample):
    from overdrive.comfy_host.quantized_lora import side_paths_of
    patched = quantized["model"]
    object_patches = dict(patched.object_patches)
    lora = lora_for(base, float_layers, LORA_LAYERS + [CONV3X3], seed=7)
    after = with_lora(patched, lora)  # LoraLoader after Quantize Model
    assert patched.object_patches == object_patches and not side_paths_of(patched)  # its input is untouched
    assert set(side_paths_of(after)) == set(quantized_layers(patched))
    assert relative_error(sample(after), sample(with_lora(base, lora))) < TOLERANCE


def sample_with_conditioning(model, positive, negative, latent):
    """The `sample` fixture's sampling on other conditioning (a hook LoRA rides on it)."""
    import comfy.sample
    noise = comfy.sample.prepare_noise(latent["samples"], 7)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, STEPS, CFG, "euler", "normal", positive, negative,
                                   latent["samples"], seed=7, disable_pbar=True)


def test_a_hook_lora_runs_beside_the_quantized_layers_as_the_same_lora_on_the_model(quantized, quantized_latent,
                                                                                     base, float_layers, prompt,
                                                                                     sample, caplog):
    """ComfyUI's hook LoRA (Create Hook LoRA, set on the conditioning) on a quantized model: its patches on quantized
    layers leave ComfyUI's hook patches (the 8-bit layers have no float weight to patch) and run beside the layers,
    as the same LoRA loaded on the model does; under a keyframe at half strength, as that LoRA at half strength."""
    import comfy.hooks
    lora = lora_for(base, float_layers, LORA_LAYERS, seed=8)
    for strength in (1.0, 0.5):
        hooks = comfy.hooks.create_hook_lora(lora, strength_model=1.0, strength_clip=0.0)
        if strength != 1.0:
            keyframes = comfy.hooks.HookKeyframeGroup()
            keyframes.add(comfy.hooks.HookKeyframe(strength=strength, start_percent=0.0))
            hooks.set_keyframes_on_hooks(keyframes)
        positive, negative = (comfy.hooks.set_hooks_for_conditioning(prompt[side], hooks)
                              for side in ("positive", "negative"))
        with caplog.at_level(logging.WARNING):
            out = sample_with_conditioning(quantized["model"], positive, negative, prompt["latent"])
        assert "could not patch" not in caplog.text and "would not patch" not in caplog.text  # ComfyUI's own warnings
        assert "not low-rank" not in caplog.text
        expected = sample(with_lora(quantized["model"], lora, strength))
        assert relative_error(out, expected) < 1e-5
        assert relative_error(out, quantized_latent) > 2 * TOLERANCE  # the LoRA ran


def test_a_patch_no_side_path_runs_is_refused_after_quantize_before_anything_is_added(quantized):
    """Each clone of a quantized model routes its add_patches (through an ON_CLONE callback)."""
    from overdrive.comfy_host.quantized_lora import NotLowRank
    clone = quantized["model"].clone()
    float_key, quantized_key = f"diffusion_model.{CONV3X3}.weight", f"diffusion_model.{LORA_LAYERS[1]}.weight"
    before = {k: list(v) for k, v in clone.patches.items()}
    with pytest.raises(NotLowRank, match="Put this LoRA loader before Quantize Model"):
        clone.add_patches({float_key: ("diff", (torch.zeros(1),)), quantized_key: ("diff", (torch.zeros(1),))})
    assert {k: list(v) for k, v in clone.patches.items()} == before  # nothing half-applied
    assert clone.add_patches({float_key: ("diff", (torch.zeros(1),))}) == [float_key]


def test_a_patch_no_side_path_runs_before_quantize_is_baked_into_a_copy_of_its_layer(quantized, node, base, prompt,
                                                                                     sample, float_layers):
    """A full weight difference (or LoHa, LoKr, DoRA) is no low-rank term: Quantize Model bakes it into a copy of that
    layer; every other clone keeps running the shared one."""
    name = LORA_LAYERS[1]
    (out_dim, in_dim), _ = float_layers[name]
    diff = torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(3)) * 0.5
    patched_float = base.clone()
    patched_float.add_patches({f"diffusion_model.{name}.weight": ("diff", (diff,))})
    baked, _ = quantize(node, patched_float, prompt, **EVERYTHING)
    shared = quantized_layers(quantized["model"])
    assert quantized_layers(baked)[name] is not shared[name]
    assert all(layer is shared[n] for n, layer in quantized_layers(baked).items() if n != name)
    assert f"diffusion_model.{name}.weight" not in baked.patches
    assert relative_error(sample(baked), sample(patched_float)) < TOLERANCE


# -------------------------------------------------------------------------------------------- with Compile Model
def test_quantize_then_compile_runs_the_int8_layers_through_torch_compile(quantized, quantized_latent, base,
                                                                          sample, float_latent):
    from overdrive.compiler import dynamo_graph_count
    from overdrive.nodes import NODES

    patched = quantized["model"]
    graphs = dynamo_graph_count()
    compiled = NODES["OverdriveCompileModel"].execute(patched, mode="default", cuda_graphs=True,
                                                                      dynamic="auto")[0]
    out = sample(compiled)
    assert dynamo_graph_count() > graphs
    tree = base.model.diffusion_model
    # Between prompts the checkpoint's layers are back in the tree; the next load swaps the 8-bit ones in again.
    assert not any(isinstance(tree.get_submodule(name), QUANTIZED_TYPES) for name in quantized_names(patched))
    assert relative_error(out, float_latent) > 1e-3  # the 8-bit layers ran: their noise is there
    # int8 rounding is a step function: compiled float math (~1e-6 off eager) flips the rounding of a few
    # activations, a one-step change each, which this random-weight model amplifies like quantization noise
    # (measured ~0.024). Both stay within the quantization tolerance of the float model.
    assert relative_error(out, quantized_latent) < TOLERANCE
    assert relative_error(out, float_latent) < TOLERANCE


def first_call_output(model, sample):
    """The output of a sampled run's first model call: the same input (the seed's noise, the first sigma) for every
    model, through the calls ComfyUI makes."""
    recorded, calls = record_calls(model)
    sample(recorded)
    return calls[0][2]


def test_quantized_calls_are_reproducible_and_compiled_matches_eager_per_call(quantized, base, sample):
    """The same input gives the same output every time, eager or compiled, whatever ran in between. Compiled int8 is
    as close to the float model as eager int8: compiled float math (~1e-6 off eager) flips the rounding of a few
    activations, so the two int8 paths differ by about the quantization noise itself (one call: 1.7-2.1 %, against
    2.5 % int8 vs float)."""
    from overdrive.nodes import NODES
    patched = quantized["model"]
    compiled = NODES["OverdriveCompileModel"].execute(patched, mode="default", cuda_graphs=True, dynamic="auto")[0]
    eager, fast, reference, eager_again, fast_again = (first_call_output(model, sample) for model in
                                                       (patched, compiled, base.clone(), patched, compiled))
    assert torch.equal(eager, eager_again) and torch.equal(fast, fast_again)
    noise = relative_error(eager, reference)
    assert noise < PER_CALL_TOLERANCE and relative_error(fast, reference) < PER_CALL_TOLERANCE
    assert relative_error(fast, eager) < 1.5 * noise


def test_compile_model_after_a_quantized_prompt_keys_and_counts_the_checkpoint_s_layers(comfy, quantized, base, sample,
                                                                                       caplog):
    """A plain Compile Model run right after a quantized prompt saw that prompt's 8-bit layers in the shared module tree:
    the quantized parameter count in its log and another architecture key."""
    from overdrive.nodes import NODES
    comfy.model_management.unload_all_models()
    with caplog.at_level(logging.INFO, logger="overdrive"):
        alone = NODES["OverdriveCompileModel"].execute(base)[0]
    sample(quantized["model"])  # the quantized prompt; ComfyUI keeps that model loaded
    after = NODES["OverdriveCompileModel"].execute(base)[0]
    forward = "diffusion_model.forward"
    assert after.object_patches[forward].fingerprint == alone.object_patches[forward].fingerprint
    assert after.object_patches[forward].graph is alone.object_patches[forward].graph


def test_compile_then_quantize_calibrates_eager_and_keeps_the_compiled_forward(comfy, node, base, prompt,
                                                                              float_layers, monkeypatch, tmp_path):
    from overdrive.compiler import CompiledMethod, dynamo_graph_count
    from overdrive.nodes import NODES

    monkeypatch.setenv("OVERDRIVE_CACHE_DIR", str(tmp_path))  # a cache miss: calibration must run
    compiled = NODES["OverdriveCompileModel"].execute(base, mode="default", cuda_graphs=True,
                                                                      dynamic="auto")[0]
    graphs = dynamo_graph_count()
    patched, report = quantize(node, compiled, prompt, quantize_linear=False, **EVERYTHING)
    assert report.calibrated and dynamo_graph_count() == graphs  # calibrated eager: nothing compiled
    assert quantized_names(patched) == eligible(float_layers, kinds=("conv",))
    forward = patched.object_patches["diffusion_model.forward"]
    assert isinstance(forward, CompiledMethod) and forward.options == compiled.object_patches[
        "diffusion_model.forward"].options
    # The 8-bit layers key the graph: the quantized model does not pose as the float model's compiled graph.
    assert forward.fingerprint != compiled.object_patches["diffusion_model.forward"].fingerprint


# -------------------------------------------------------------------------------------------- inputs and failures
@pytest.mark.parametrize("settings, message", [
    (dict(bits=6), "bits=6 is not supported.*Use bits=8"),
    (dict(bits=4), "no 4-bit path.*int4_fp8 needs .*or use bits=8"),  # the CPU: 4 bits compute in fp8
    (dict(format="int4"), "format='int4' is unknown"),
    (dict(conv_mse_threshold=-0.1), "conv_mse_threshold=-0.1 is negative. Use 0 or more"),
    (dict(linear_mse_threshold=-1.0), "linear_mse_threshold=-1.0 is negative"),
    (dict(compute_density_threshold=-5.0), "compute_density_threshold=-5.0 is negative"),
    (dict(calibration_steps=0), "calibration_steps=0; use a whole number from 1"),
    (dict(latent={"samples": torch.zeros(4, 8, 8)}), "latent is not a LATENT"),
    (dict(positive="a cat"), "positive is not a CONDITIONING"),
])
def test_bad_settings_are_refused_with_a_clear_error(node, base, settings, message):
    with pytest.raises(ValueError, match=message):
        node.execute(base, **settings)


def test_fp8_on_a_device_without_fp8_matmul_is_refused(node, base):
    # This CPU build of torch runs fp8 through torch._scaled_mm, so the CPU takes fp8: a model whose load device
    # has no 8-bit matmul at all (the meta device) stands for a GPU older than Ampere.
    model = base.clone()
    model.load_device = torch.device("meta")
    with pytest.raises(ValueError, match="format='fp8_e4m3' needs torch._scaled_mm.*8.9.*Leave quantization off"):
        node.execute(model, format="fp8_e4m3")


def test_a_failure_while_quantizing_returns_the_unquantized_model_with_a_warning(node, base, prompt, caplog,
                                                                                  monkeypatch, tmp_path, new_process):
    monkeypatch.setenv("OVERDRIVE_CACHE_DIR", str(tmp_path))  # a cache miss: calibration must run
    wrong = [[torch.zeros(1, 77, 512), {}]]  # SD1.5 takes 768-wide text embeddings: the calibration run fails
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        patched, report = quantize(node, base, {**prompt, "positive": wrong, "negative": wrong}, **EVERYTHING)
    assert report is None and quantized_names(patched) == set() and patched.model is base.model
    assert "quantizing failed, so the model runs unquantized" in caplog.text


def test_without_prompt_or_latent_calibration_uses_empty_conditioning_at_the_natural_size(comfy, base):
    from overdrive.comfy_host.quantize_calibration import CalibrationRun

    run = CalibrationRun.build(base, None, None, None, 2)
    assert run.empty_conditioning and tuple(run.latent.shape) == (1, 4, 64, 64)  # SD1.5: 512² pixels
    assert tuple(run.positive[0][0].shape) == (1, 77, 768) and not run.positive[0][0].any()
    sdxl = build_model(comfy, "sdxl", "tiny", torch.float32)
    run = CalibrationRun.build(sdxl, None, None, None, 1)
    assert tuple(run.latent.shape) == (1, 4, 128, 128)  # SDXL: 1024²
    cond, extra = run.negative[0]
    assert tuple(cond.shape) == (1, 77, 2048) and tuple(extra["pooled_output"].shape) == (1, 1280)
    # The real SDXL model samples with that conditioning (one step, at a small latent to keep the CPU quick).
    small = CalibrationRun.build(sdxl, None, None, {"samples": torch.zeros(1, 4, 8, 8)}, 1)
    small(sdxl.clone())


# -------------------------------------------------------------------------------------------- in a real server
def test_compile_quantize_workflow_runs_to_an_image_through_the_server(client, server):
    from test_server import latent_of, small, with_latent_output

    info = client.object_info()["OverdriveQuantizeModel"]
    assert info["display_name"] == "Quantize Model (Overdrive)" and info["description"]
    for section in ("required", "optional"):
        for name, spec in info["input"][section].items():
            assert len(spec) > 1 and spec[1].get("tooltip"), f"{name} has no tooltip"
    workflow = small(load_workflow("compile_quantize_sd15_api.json"))
    set_inputs(workflow, "OverdriveQuantizeModel", compute_density_threshold=0.0, calibration_steps=2)
    set_inputs(workflow, "KSampler", cfg=CFG)
    eager = client.run(with_latent_output(without_overdrive(workflow), "eager"))
    result = client.run(with_latent_output(workflow, "quantized"))
    (image,) = client.output_files(result, server.output_dir)
    assert image.is_file() and image.stat().st_size > 0
    out = latent_of(result, server)
    assert torch.isfinite(out).all() and relative_error(out, latent_of(eager, server)) < TOLERANCE
    log = server.log_text()
    assert "99 of 119 layers quantized" in log and "cache miss, calibrated" in log


def test_switch_weights_on_a_quantized_model_requantizes_the_same_layers_from_the_new_weights(
        comfy, quantized, quantized_latent, node, prompt, sample, builtin_checkpoints):
    """Quantize -> (sampled, so its layers are in the tree) -> SwitchWeights: the new checkpoint's weights in the
    same 8-bit layers, equal to quantizing that checkpoint directly; the quantized model that ran is unchanged."""
    import os

    import folder_paths
    from overdrive.nodes import NODES

    path = builtin_checkpoints["overdrive-builtin-sd15-seed1.safetensors"]
    folder_paths.add_model_folder_path("checkpoints", os.path.dirname(path))
    model = quantized["model"]
    switched = NODES["OverdriveSwitchWeights"].execute(model, os.path.basename(path))[0]
    assert set(quantized_names(switched)) == set(quantized_names(model))
    out = sample(switched)
    assert relative_error(out, quantized_latent) > 0.05  # other weights ran

    import comfy.sd
    other = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]
    direct, _ = quantize(node, other, prompt, **EVERYTHING)
    assert relative_error(out, sample(direct)) < TOLERANCE
    assert torch.equal(sample(model), quantized_latent)  # the model that was running is untouched


class LinearThenConv(torch.nn.Module):
    """A block whose second layer is a 1x1 conv over the rows as pixels: its 8-bit layer keeps its tensors in its inner
    GEMM."""

    def __init__(self):
        super().__init__()
        self.linear, self.conv = torch.nn.Linear(64, 64), torch.nn.Conv2d(64, 64, 1)

    def forward(self, x):
        return self.conv(torch.nn.functional.gelu(self.linear(x)).T[None, :, :, None])[0, :, :, 0].T


def test_8_bit_layers_beyond_the_room_stream_block_by_block_with_the_same_output(comfy):
    """On a card too small for every 8-bit layer (Flux in fp8 on an 8 GiB card), the last blocks' layers stay in host
    memory and each block copies its own in as it runs (comfy_host/quantized_streaming.py). Here the CPU stands for both
    sides: what is checked is the split, the hooks' swap and that the model computes the same."""
    from overdrive.comfy_host.quantized_streaming import StreamedBlocks, block_of, split_by_room, tensor_bytes
    torch.manual_seed(0)
    tree = torch.nn.Module()
    mlps = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(2)]
    tree.blocks = torch.nn.ModuleList([*mlps, LinearThenConv()])
    tree.head = torch.nn.Linear(64, 64)
    layers = {name: Int8Linear.from_float(tree.get_submodule(name)) for name in
              ("blocks.0.0", "blocks.1.0", "blocks.2.linear", "head")}
    layers["blocks.2.conv"] = QuantConv2d1x1.from_float(tree.blocks[2].conv, "int8")
    assert [block_of(tree, name) for name in layers] == ["blocks.0", "blocks.1", "blocks.2", None, "blocks.2"]
    one = tensor_bytes(layers["blocks.0.0"])
    assert tensor_bytes(layers["blocks.2.conv"]) == one  # the inner GEMM's tensors are counted
    resident, streamed = split_by_room(tree, layers, room=one + one // 2)
    assert sorted(resident) == ["blocks.0.0", "head"]  # a layer outside every block always stays
    assert {block: sorted(names) for block, names in streamed.items()} == {
        "blocks.1": ["blocks.1.0"], "blocks.2": ["blocks.2.conv", "blocks.2.linear"]}
    assert split_by_room(tree, layers, room=None) == (layers, {})

    def run(x):
        for block in tree.blocks:
            x = block(x)
        return tree.head(x)
    for name, layer in layers.items():
        parent, _, attribute = name.rpartition(".")
        setattr(tree.get_submodule(parent) if parent else tree, attribute, layer)
    x = torch.randn(4, 64)
    expected = run(x)
    streaming = StreamedBlocks()
    streaming.start(tree, streamed, "cpu")
    # the streamed blocks run without a CUDA graph: their layers' addresses are the allocator's of each call
    assert [WeightsOfBlock(block).why_not(torch.device("cpu")) is not None for block in tree.blocks] == \
        [False, True, True]
    calls = []
    tree.blocks[1].register_forward_pre_hook(lambda block, args: calls.append(layers["blocks.1.0"].weight_q))
    assert torch.equal(run(x), expected)
    host = next(tensor for _, name, tensor in streaming.pinned[id(layers["blocks.1.0"])] if name == "weight_q")
    assert len(calls) == 1 and torch.equal(calls[0], host)  # (on a GPU, a copy on it: bench/ at 8 GiB)
    # Outside its block's call a streamed layer holds nothing ComfyUI's loader would move onto the GPU ...
    assert layers["blocks.1.0"].weight_q is None and "blocks.1.0.weight_q" not in dict(tree.named_buffers())
    assert layers["blocks.2.conv"].gemm.weight_q is None
    streaming.stop()  # ... and once the run is over it is whole again
    assert layers["blocks.1.0"].weight_q is host and layers["blocks.2.conv"].gemm.weight_q is not None
    assert all(WeightsOfBlock(block).why_not(torch.device("cpu")) is None for block in tree.blocks)
    assert len(tree.blocks[1]._forward_pre_hooks) == 1  # only this test's own hook is left


def test_a_streamed_block_brings_in_the_layers_its_lora_side_paths_run(comfy):
    """With a LoRA every quantized layer runs beside a side path, which the tree holds in the layer's place: a streamed
    block still copies the layers in (its hook looks through the side path), and computes the layer with its LoRA."""
    from overdrive.comfy_host.quantized_streaming import StreamedBlocks
    from overdrive.quantization.low_rank import LowRankSidePath, LowRankTerm
    torch.manual_seed(0)
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 64)) for _ in range(2)])
    layers = {f"blocks.{i}.0": Int8Linear.from_float(tree.blocks[i][0]) for i in range(2)}
    paths = {name: LowRankSidePath(layer, 32, torch.float32) for name, layer in layers.items()}
    for name, path in paths.items():
        path.write([LowRankTerm(torch.randn(64, 4), torch.randn(4, 64) * 0.1, 0.5)])
        tree.get_submodule(name.rpartition(".")[0])[0] = path
    x = torch.randn(4, 64)
    expected = tree.blocks[1](tree.blocks[0](x))
    streaming = StreamedBlocks()
    streaming.start(tree, {"blocks.1": {"blocks.1.0": layers["blocks.1.0"]}}, "cpu")
    assert layers["blocks.1.0"].weight_q is None  # streamed: empty outside its block's call
    assert torch.equal(tree.blocks[1](tree.blocks[0](x)), expected)
    streaming.stop()


def test_room_is_kept_for_the_float_tensors_comfyui_loads_after_the_quantized_layers(comfy, monkeypatch):
    """ComfyUI's loader brings the model's float tensors (norms, embeddings, a block's own tensors) onto the card after
    the quantized layers are placed: their room is kept, or the classic loader would load them beyond the card."""
    from overdrive.comfy_host import quantized_streaming
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])
    tree.norm = torch.nn.LayerNorm(64)
    layers = {f"blocks.{i}": Int8Linear.from_float(tree.blocks[i]) for i in range(2)}
    norm = quantized_streaming.tensor_bytes(tree.norm)
    assert quantized_streaming.float_bytes_to_load(tree, layers, "cpu") == 0  # already there
    assert quantized_streaming.float_bytes_to_load(tree, layers, "meta") == norm  # the float layers replaced: not
    one = quantized_streaming.tensor_bytes(layers["blocks.0"])
    monkeypatch.setattr(quantized_streaming, "room_for_weights", lambda device, activations: 2 * one)
    streaming = quantized_streaming.StreamedBlocks()
    streamed = quantized_streaming.place(tree, layers, "meta", streaming, lambda modules, device: None)
    # room for the two layers less the norm's: they do not both stay, and the copy ahead of a streamed block takes
    # the room of the other
    assert streamed == 2 * one
    streaming.stop()


def test_the_cards_cached_float_weights_give_way_to_the_quantized_layers(comfy, monkeypatch):
    """ComfyUI's dynamic VRAM keeps float weights cached on the card while memory allows (those of the layers now
    quantized among them, from the calibration run): placing the quantized layers frees as much of that cache as they
    need first, and streams only what still does not fit."""
    from overdrive.comfy_host import quantized_streaming
    torch.manual_seed(0)
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
    layers = {f"blocks.{i}": Int8Linear.from_float(tree.blocks[i]) for i in range(3)}
    one = quantized_streaming.tensor_bytes(layers["blocks.0"])
    card = {"room": one}
    monkeypatch.setattr(quantized_streaming, "room_for_weights", lambda device, activations: card["room"] - activations)
    asked, moved = [], []

    def free_cache(size):
        asked.append(size)
        card["room"] += size // 2  # the cache holds only half of what is asked
        return size // 2
    streaming = quantized_streaming.StreamedBlocks()
    streamed = quantized_streaming.place(tree, layers, "meta", streaming, lambda modules, device: moved.extend(modules),
                                         free_cache, activations=0)
    # room for two after the cache gave half: one resident, one for the block copied ahead of the running one
    assert asked == [2 * one] and moved == [layers["blocks.0"]] and streamed == 2 * one
    streaming.stop()
    card["room"], asked[:] = 3 * one, []  # all of them fit: nothing streams, so nothing is copied ahead
    assert quantized_streaming.place(tree, layers, "meta", streaming, lambda modules, device: None, free_cache) == 0
    assert not asked  # room enough: the cache stays
    # a sampling whose activations take one layer's room: that layer streams (with the block copied ahead of it)
    assert quantized_streaming.place(tree, layers, "meta", streaming, lambda modules, device: None, None,
                                     activations=one) == 2 * one
    streaming.stop()


def test_a_compiled_models_working_memory_is_kept_where_its_quantized_layers_stream(comfy, monkeypatch):
    """Compile Model's working memory (its CUDA graphs' pool beside the streamed copies) is kept free as well where
    some quantized layers stream anyway; where they all fit, placement is unchanged (the fit check counted it)."""
    from overdrive.comfy_host import quantized_streaming
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
    layers = {f"blocks.{i}": Int8Linear.from_float(tree.blocks[i]) for i in range(3)}
    one = quantized_streaming.tensor_bytes(layers["blocks.0"])
    card = {"room": 3 * one}
    monkeypatch.setattr(quantized_streaming, "room_for_weights", lambda device, activations: card["room"] - activations)
    streaming = quantized_streaming.StreamedBlocks()

    def streamed(workspace):
        out = quantized_streaming.place(tree, layers, "meta", streaming, lambda modules, device: None,
                                        streaming_workspace=workspace)
        streaming.stop()
        return out
    assert streamed(one) == streamed(0) == 0  # all fit: the workspace is not taken from them
    card["room"] = 5 * one // 2
    assert streamed(0) == 2 * one  # one resident, one streamed and its copy ahead
    assert streamed(one) == 3 * one  # a layer's room less: none resident


def test_a_quantized_sampling_keeps_comfyuis_activation_estimate_for_placing_its_layers(quantized, sample, prompt):
    """The quantized layers are placed at the load that a sampling starts; the room they leave for activations is
    ComfyUI's own estimate for that sampling's latent (what its partial loader keeps free), not a fixed reserve."""
    from overdrive.comfy_host import quantize_patches
    model = quantized["model"]
    follower = quantize_patches.followers(model)[0]
    follower.activations_bytes = 0
    sample(model)
    latent = prompt["latent"]["samples"]
    expected = int(model.model.memory_required([1, *latent.shape[1:]]))
    assert expected > 0 and follower.activations_bytes == expected


def test_a_measured_run_of_the_same_kind_replaces_comfyuis_estimate_when_placing(quantized, sample, prompt):
    """Once a sampling of one kind (latent shape, conditioning, compiled or not) completed and was measured on the GPU,
    the next load keeps that working memory and its margin free instead of ComfyUI's estimate and the compiled floor;
    another kind still gets the estimate. (The CPU measures nothing: the measurement itself runs in
    test_dynamic_vram_gpu.py.)"""
    from overdrive.comfy_host import quantize_patches, working_memory
    from overdrive.comfy_host.gpu_budget import ACTIVATIONS_BYTES
    model = quantized["model"]
    follower = quantize_patches.followers(model)[0]
    sample(model)
    latent = prompt["latent"]["samples"]
    assert follower.sampling_key[0] == (1, *latent.shape[1:]) and not follower.working_memory.measured
    assert follower.working_memory.completed[follower.sampling_key] >= 1  # ComfyUI's sampler ran the wrapper
    estimate = (max(ACTIVATIONS_BYTES, follower.activations_bytes), follower.workspace_bytes)
    assert follower.kept_free() == estimate
    follower.working_memory.measured[follower.sampling_key] = 2**30
    assert follower.kept_free() == (2**30 + int(2**30 * working_memory.MARGIN_FRACTION), 0)
    follower.sampling_key = ((2, *latent.shape[1:]), *follower.sampling_key[1:])
    assert follower.kept_free() == estimate
    follower.working_memory.measured.clear()


def test_compiled_blocks_run_their_streamed_layers_as_resident_ones_without_recompiling(comfy, tmp_path):
    """Compile Model over a quantized model whose layers do not all fit: each streamed block's layers are swapped in
    before its compiled forward and emptied after, at every call; the compiled blocks compute what the eager ones do
    and compile once, not at each call."""
    from overdrive.compiler import CompiledMethod, CompileOptions
    from overdrive.compiler.shared_graph import dynamo_graph_count
    from overdrive.comfy_host.quantized_streaming import StreamedBlocks
    torch.manual_seed(0)
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                       for _ in range(3)])
    layers = {f"blocks.{i}.0": Int8Linear.from_float(tree.blocks[i][0]) for i in range(3)}
    for i in range(3):
        tree.blocks[i][0] = layers[f"blocks.{i}.0"]

    def run(x):
        for block in tree.blocks:
            x = block(x)
        return x
    x = torch.randn(4, 64)
    expected = run(x)
    options = CompileOptions(cache_dir=str(tmp_path))  # Compile Model's defaults: precompiled frames included
    for block in tree.blocks:
        block.forward = CompiledMethod(block, "forward", options)
    streaming = StreamedBlocks(CloningCopies())  # new tensors at each call, as copies onto a GPU are
    streaming.start(tree, {f"blocks.{i}": {f"blocks.{i}.0": layers[f"blocks.{i}.0"]} for i in (1, 2)}, "cpu")
    before = dynamo_graph_count()
    first = run(x)
    graphs = dynamo_graph_count()
    outputs = [run(x) for _ in range(3)]
    assert graphs > before and all(block.forward.graph.failure is None for block in tree.blocks)  # compiled
    assert dynamo_graph_count() == graphs  # buffers swapped in at each call are inputs, not a reason to recompile
    assert relative_error(first, expected) < 1e-2 and all(torch.equal(out, first) for out in outputs)
    assert layers["blocks.1.0"].weight_q is None  # emptied outside its block's call, compiled or not
    streaming.stop()


class CloningCopies:
    """InlineCopies that hand over new tensors, as a copy onto another device does."""

    device = torch.device("cpu")

    def send(self, tensors):
        return [tensor.clone() for tensor in tensors]

    def receive(self, ticket):
        return ticket


class CountingCopies:
    """InlineCopies that says which block's tensors each copy was for."""

    def __init__(self, blocks):
        self.device, self.sent, self.blocks = torch.device("cpu"), [], blocks

    def send(self, tensors):
        self.sent.append(next(name for name, layer in self.blocks.items() if tensors[0] is layer.weight_q_host))
        return list(tensors)

    def receive(self, ticket):
        return ticket


class CopiesWithoutRoomAhead(CountingCopies):
    """CountingCopies whose copy made ahead (right after a block received its own, still in use) runs out of memory."""

    after_receive = False

    def send(self, tensors):
        if self.after_receive:
            self.after_receive = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return super().send(tensors)

    def receive(self, ticket):
        self.after_receive = True
        return ticket


def three_streamed_int8_blocks():
    """Three blocks of one int8 layer each, their outputs, and a StreamedBlocks holding their host copies (each layer's
    `weight_q_host` names its copy, for the copy classes above)."""
    from overdrive.comfy_host.quantized_streaming import StreamedBlocks
    torch.manual_seed(0)
    tree = torch.nn.Module()
    tree.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
    layers = {f"blocks.{i}": Int8Linear.from_float(tree.blocks[i]) for i in range(3)}
    for i in range(3):
        tree.blocks[i] = layers[f"blocks.{i}"]
    x = torch.randn(4, 64)
    expected = [tree.blocks[i](x) for i in range(3)]
    streaming = StreamedBlocks()
    for layer in layers.values():
        layer.weight_q_host = next(t for _, buffer, t in streaming.host_copies(layer) if buffer == "weight_q")
    return tree, layers, x, expected, streaming


def test_a_block_whose_copy_ahead_finds_no_room_copies_its_own_and_computes_the_same(comfy, caplog):
    """Out of memory for the copy made ahead is no failure of the generation: the next block copies its own when it
    starts, with one warning."""
    tree, layers, x, expected, streaming = three_streamed_int8_blocks()
    streaming.copies = copies = CopiesWithoutRoomAhead({name.split(".")[1]: layer for name, layer in layers.items()})
    streaming.start(tree, {f"blocks.{i}": {f"blocks.{i}": layers[f"blocks.{i}"]} for i in range(3)}, "cpu")
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        for _ in range(2):
            assert all(torch.equal(tree.blocks[i](x), expected[i]) for i in range(3))
    assert copies.sent == ["0", "1", "2"] * 2 and streaming.ahead is None  # each its own, none ahead
    assert sum("copy the next block" in r.getMessage() for r in caplog.records) == 1
    streaming.stop()


def test_streamed_blocks_copy_the_next_block_ahead_and_a_block_out_of_order_copies_its_own(comfy):
    """Each streamed block's copy starts as the block before it starts (the last one fetches the first for the next
    model call), so that on the GPU it overlaps that block's compute; a block that runs out of that order copies its
    own at once, and the copy made ahead is dropped. Outputs match the resident model's every time."""
    tree, layers, x, expected, streaming = three_streamed_int8_blocks()
    streamed = {f"blocks.{i}": {f"blocks.{i}": layers[f"blocks.{i}"]} for i in range(3)}
    streaming.copies = copies = CountingCopies({name.split(".")[1]: layer for name, layer in layers.items()})
    streaming.start(tree, streamed, "cpu")
    for _ in range(2):  # two model calls in order: block 0's own copy once, then every copy is made ahead
        assert all(torch.equal(tree.blocks[i](x), expected[i]) for i in range(3))
    assert copies.sent == ["0", "1", "2", "0", "1", "2", "0"]
    copies.sent.clear()
    assert torch.equal(tree.blocks[2](x), expected[2])  # out of order: block 0 was ahead
    assert copies.sent == ["2", "0"] and streaming.ahead[0] == 0
    streaming.stop()
    assert streaming.ahead is None and all(layer.weight_q is not None for layer in layers.values())
