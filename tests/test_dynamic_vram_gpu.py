"""Every node on ComfyUI's default NVIDIA path: dynamic VRAM (ModelPatcherDynamic with comfy-aimdo), the built-in
tiny Flux.1 and Wan 2.2 files loaded by ComfyUI's own loader as Load Diffusion Model loads them, sampled by its
sampler. Fidelity per model call against eager on the same dynamic-VRAM model.

Skipped without CUDA (CI has no GPU); run on the GPU machine, apart from the CPU suite (this imports ComfyUI for the
GPU): `python3 -m pytest tests/test_dynamic_vram_gpu.py`."""
import logging

import pytest
import torch

from overdrive.builtin_models.quantized import LAYOUTS
from overdrive.compiler import dynamo_graph_count
from test_dit_families import (CFG, FRAMES, RES, STEPS, assert_calls_match, base, compiled,  # noqa: F401
                               conditioning, eager, empty_latent, first_file, models_folder, nodes,
                               quantize_every_layer, record_calls, sample, second_file)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PER_CALL_TOLERANCE = 2e-2  # compiled vs eager in bf16
FP8_TOLERANCE = 0.1
INT4_TOLERANCE = 0.3  # 4-bit weights on random weights, every layer
log = logging.getLogger("overdrive")


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False, dynamic_vram=True)


@pytest.fixture(scope="module", params=["flux", "wan22"])
def family(request):
    return request.param


def test_the_loader_gives_a_dynamic_vram_model(base):
    assert base.is_dynamic(), type(base).__name__


def test_compile_model_takes_the_classic_loader_and_replays_its_blocks_as_cuda_graphs(compiled, base, sample, eager,
                                                                                     family, caplog):
    assert not compiled.is_dynamic() and base.is_dynamic()  # the input MODEL keeps dynamic VRAM
    out, calls = sample(compiled)
    error = assert_calls_match(calls, eager[1], PER_CALL_TOLERANCE)
    graphs = dynamo_graph_count()
    with caplog.at_level(logging.INFO, logger="overdrive"):
        sample(compiled)
    assert dynamo_graph_count() == graphs
    assert "runs without a CUDA graph" not in caplog.text, caplog.text[-2000:]
    described = compiled.object_patches["diffusion_model.forward"].graphs.describe()
    log.info("%s on dynamic VRAM: compiled per-call error %.2e, block graphs %s", family, error, described)
    assert torch.isfinite(out).all()


def test_the_step_cache_over_the_compiled_model_samples(nodes, compiled, sample, eager):
    cached = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
    out, calls = sample(cached)
    assert_calls_match(calls[:1], eager[1][:1], PER_CALL_TOLERANCE)  # the first step runs in full
    assert torch.isfinite(out).all()


def test_the_step_cache_alone_samples_on_dynamic_vram(nodes, base, sample, eager, family):
    cached = nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=2)[0]
    assert cached.is_dynamic()
    out, calls = sample(cached)
    # The first step runs every block, through the blockwise forward rather than the model's own (bf16 rounding).
    error = assert_calls_match(calls[:1], eager[1][:1], PER_CALL_TOLERANCE)
    log.info("%s on dynamic VRAM: the step cache's full step %.2e from eager", family, error)
    assert torch.isfinite(out).all()


def test_quantize_model_fp8_then_compile_model(nodes, base, family, sample, eager):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    report, quantized = quantize_every_layer(nodes, base, family, "fp8_e4m3")
    assert report is not None and report.quantized, "quantizing fell back"
    error_eager = assert_calls_match(sample(quantized)[1], eager[1], FP8_TOLERANCE)
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    assert not both.is_dynamic()
    error = assert_calls_match(sample(both)[1], eager[1], FP8_TOLERANCE)
    log.info("%s on dynamic VRAM: %d layers fp8, per-call error %.2e eager, %.2e compiled", family,
             len(report.quantized), error_eager, error)


def test_compile_model_alone_right_after_the_quantized_model_loaded_fresh(comfy, nodes, base, family, sample, eager):
    """The quantized classic copy loaded from nothing (its float layers on the host, out of the tree while it loads),
    then Compile Model alone on the same file: ComfyUI reuses that whole load for the float clone without moving a
    weight, and every float layer must be on the GPU at its first call (it failed "mat1 is on cuda:0, different from
    other tensors on cpu")."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    _, quantized = quantize_every_layer(nodes, base, family, "fp8_e4m3")
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    comfy.model_management.unload_all_models()
    sample(both)
    alone = nodes["OverdriveCompileModel"].execute(base)[0]
    assert_calls_match(sample(alone)[1], eager[1], PER_CALL_TOLERANCE)


def test_a_lora_strength_change_on_quantize_and_compile_replays_every_recorded_block(comfy, nodes, base, family,
                                                                                   first_file, models_folder, sample):
    """The iteration loop's commonest change: a LoRA's strength only. The side paths take it in place, so ComfyUI
    reloads nothing (a reload moved the 8-bit layers to the host and back, and every block was recorded again) and each
    block replays the CUDA graph recorded at the first strength."""
    import comfy.sd
    import comfy.utils

    from overdrive.builtin_models.lora import ensure_lora

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    lora = comfy.utils.load_torch_file(str(ensure_lora(first_file, models_folder)))

    def with_lora(strength):
        return comfy.sd.load_lora_for_models(base, None, lora, strength, 0)[0]

    def quantized_and_compiled(strength):
        return nodes["OverdriveCompileModel"].execute(quantize_every_layer(nodes, with_lora(strength), family,
                                                                           "fp8_e4m3")[1])[0]
    strong = quantized_and_compiled(0.8)
    sample(strong)
    sample(strong)
    weak = quantized_and_compiled(0.4)
    graphs = weak.object_patches["diffusion_model.forward"].graphs
    recorded, replays = graphs.recorded, graphs.replays
    assert recorded > 0 and graphs is strong.object_patches["diffusion_model.forward"].graphs
    _, calls = sample(weak)
    assert (graphs.recorded, graphs.recorded_again) == (recorded, 0) and graphs.replays > replays, graphs.describe()
    assert_calls_match(calls, sample(with_lora(0.4))[1], FP8_TOLERANCE)


def test_sparse_video_attention_compiled_replays_its_blocks_and_matches_its_uncompiled_calls(nodes, base, family):
    """Wan over 5 latent frames, half its steps dense: compiled with CUDA graphs, every block records and replays (the
    phase switches the mask's tables in place), and each model call matches the same sparse model uncompiled."""
    import comfy.sample

    if family != "wan22":
        pytest.skip("a video family's node")
    latent = empty_latent(family, RES, RES, 17)

    def calls_of(model):
        recorded, calls = record_calls(model)
        comfy.sample.sample(recorded, comfy.sample.prepare_noise(latent, 7), STEPS + 2, CFG, "euler", "simple",
                            conditioning(family, 1), conditioning(family, 2), latent, seed=7, disable_pbar=True)
        return calls
    sparse = nodes["OverdriveSparseVideoAttention"].execute(base, dense_steps=0.5)[0]
    both = nodes["OverdriveCompileModel"].execute(sparse)[0]
    expected = calls_of(sparse)
    calls_of(both)
    calls = calls_of(both)
    graphs = both.object_patches["diffusion_model.forward"].graphs
    assert graphs.recorded > 0 and graphs.replays > 0, graphs.describe()
    assert_calls_match(calls, expected, PER_CALL_TOLERANCE)


def test_8_bit_layers_a_short_card_has_no_room_for_stream_block_by_block(comfy, nodes, base, family, sample,
                                                                          monkeypatch):
    """A card too small for every 8-bit layer (fp8 Flux on an 8 GiB card): the layers beyond the room stay in pinned
    host memory and their blocks copy them in as they run (comfy_host/quantized_streaming.py), on dynamic VRAM, whose
    loader moves every buffer it finds onto the GPU. The tiny model fits any card, so the room is set to half of its
    8-bit layers' bytes. Same kernels on the same inputs: the calls match the resident run's. Compile Model over it
    takes the classic loader (the card holds its float part) and its compiled blocks run through the streamed layers."""
    from overdrive.comfy_host import dynamic_vram, quantized_streaming
    from overdrive.comfy_host.quantized_state import followers, quantized_modules, resident_bytes

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    report, quantized = quantize_every_layer(nodes, base, family, "fp8_e4m3")
    assert report is not None and report.quantized, "quantizing fell back"
    _, resident_calls = sample(quantized)
    layers = quantized_modules(quantized)
    half = sum(quantized_streaming.tensor_bytes(layer) for layer in layers.values()) // 2
    monkeypatch.setattr(quantized_streaming, "room_for_weights", lambda device, activations: half)
    comfy.model_management.unload_all_models()  # the next load places the layers again, by the room
    out, calls = sample(quantized)
    assert followers(quantized)[0].streamed_bytes > 0
    assert_calls_match(calls, resident_calls, 1e-3)
    streaming = followers(quantized)[0].streaming
    streamed = [layer for layer in layers.values() if id(layer) in streaming.pinned]
    assert streamed and len(streamed) < len(layers)
    assert not streaming.handles  # the run is over: no hook left on the shared module tree ...
    assert all(t.device.type == "cpu" and t.is_pinned()  # ... and the streamed layers whole, in host memory
               for layer in streamed for t in layer._buffers.values() if t is not None)
    assert torch.isfinite(out).all()
    # a card with room for the float part and the working memory, not for every quantized layer
    float_part = resident_bytes(quantized) - sum(quantized_streaming.tensor_bytes(layer) for layer in layers.values())
    monkeypatch.setattr(dynamic_vram, "gpu_budget_bytes", lambda device: dynamic_vram.with_workspace(float_part))
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    assert not both.is_dynamic()
    comfy.model_management.unload_all_models()
    out, compiled_calls = sample(both)
    assert followers(both)[0].streamed_bytes > 0 and torch.isfinite(out).all()
    error = assert_calls_match(compiled_calls, resident_calls, FP8_TOLERANCE)
    log.info("%s: compiled blocks over streamed fp8 layers, per-call error %.2e from the resident eager run", family,
             error)


def test_a_quantized_model_that_streams_by_comfyuis_estimate_fits_once_a_run_is_measured(comfy, nodes, base, family,
                                                                                         sample, monkeypatch):
    """ComfyUI's estimate of a call's activations kept a 4-bit Flux that fits an 8 GiB card whole streaming part of its
    layers. The tiny model's estimate and card are set so that the estimate streams and the measure fits (below):
    the first two runs stream by the estimate, the second's working memory is measured (PyTorch's peak, less the streamed
    copies in flight; the first's peaks are one-time), and the next run's load keeps that and its margin free instead:
    every layer resident, the same calls."""
    from overdrive.comfy_host import quantized_streaming
    from overdrive.comfy_host.quantized_state import followers, quantized_modules

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    _, quantized = quantize_every_layer(nodes, base, family, "fp8_e4m3")
    layers = sum(quantized_streaming.tensor_bytes(layer) for layer in quantized_modules(quantized).values())
    # ComfyUI's estimate for this latent set to 2 GiB, as Flux's at 1024² exceeds what its compiled run needs; the card
    # holds the layers and 1 GiB: the estimate streams, the measured run's reserve (at least 0.8 GiB) fits
    monkeypatch.setattr(quantized.model, "memory_required", lambda input_shape, cond_shapes={}: 2 * 2**30)
    monkeypatch.setattr(quantized_streaming, "room_for_weights", lambda device, kept: layers + 2**30 - kept)
    comfy.model_management.unload_all_models()  # the next load places the layers again, by the room
    _, first = sample(quantized)
    follower = followers(quantized)[0]
    assert follower.streamed_bytes > 0 and not follower.working_memory.measured  # the first run's peaks are one-time
    sample(quantized)
    assert follower.streamed_bytes > 0
    measured = follower.working_memory.measured[follower.sampling_key]  # a tiny model's: far below the margin
    assert 0 <= measured < 2**27, measured
    _, third = sample(quantized)
    assert follower.streamed_bytes == 0
    assert_calls_match(third, first, 1e-3)
    comfy.model_management.unload_all_models()


def test_quantize_model_4_bits_then_compile_model(nodes, base, family, sample, eager):
    """int4 weights wherever the tiny model's layers take them (a threshold every layer passes), fp8 for the rest,
    eager and compiled on dynamic VRAM; the error per model call is 4 bits' on random weights."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("int4_fp8 computes in fp8: compute capability 8.9")
    report, quantized = quantize_every_layer(nodes, base, family, "int4_fp8", linear_mse_threshold=1.0)
    assert report is not None, "quantizing fell back"
    in_4_bits = [name for name, fmt in report.formats().items() if fmt == "int4_fp8"]
    assert len(in_4_bits) > len(report.quantized) / 2, report.summary()
    error_eager = assert_calls_match(sample(quantized)[1], eager[1], INT4_TOLERANCE)
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    error = assert_calls_match(sample(both)[1], eager[1], INT4_TOLERANCE)
    log.info("%s on dynamic VRAM: %d of %d layers int4, per-call error %.2e eager, %.2e compiled", family,
             len(in_4_bits), len(report.quantized), error_eager, error)


class RecordedLog(logging.Handler):
    """Every record the root logger gets while installed (ComfyUI's own warnings included)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_long_mix_of_prompts_leaves_no_model_and_no_memory_behind(comfy, nodes, base, family, sample):
    """Every node in turn on one model, each model dropped and unloaded after its prompt, three times over: once the
    first round has built what is kept on purpose (compiled graphs, decision caches), GPU memory after each unload and
    the process's host memory stay at that level, and ComfyUI never reports a model kept alive."""
    import gc

    import psutil

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the mix quantizes in fp8 and 4 bits: compute capability 8.9")
    management, process = comfy.model_management, psutil.Process()

    def fp8(model):
        return quantize_every_layer(nodes, model, family, "fp8_e4m3")[1]

    def int4(model):
        return quantize_every_layer(nodes, model, family, "int4_fp8", linear_mse_threshold=1.0)[1]

    def compile_model(model):
        return nodes["OverdriveCompileModel"].execute(model)[0]

    def cached(model):
        return nodes["OverdriveDeepCache"].execute(model, mode="fixed", cache_interval=2)[0]
    recipes = {"eager": lambda: base.clone(), "compile": lambda: compile_model(base), "fp8": lambda: fp8(base),
               "4-bit": lambda: int4(base), "step cache": lambda: cached(base),
               "fp8 + compile + step cache": lambda: cached(compile_model(fp8(base)))}

    def settled():
        management.unload_all_models()
        gc.collect()
        management.soft_empty_cache()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(), process.memory_info().rss

    log = RecordedLog()
    logging.getLogger().addHandler(log)
    try:
        levels = []
        for _ in range(3):
            for name, make in recipes.items():
                model = make()
                assert torch.isfinite(sample(model)[0]).all(), name
                del model
                levels.append((name, *settled()))
    finally:
        logging.getLogger().removeHandler(log)
    baseline_gpu = max(gpu for _, gpu, _ in levels[:len(recipes)])
    baseline_host = max(host for _, _, host in levels[:len(recipes)])
    grown = [(name, (gpu - baseline_gpu) / 2**20) for name, gpu, _ in levels[len(recipes):]
             if gpu > baseline_gpu + 64 * 2**20]
    assert not grown, grown  # MiB above the first round's level
    assert levels[-1][2] < baseline_host + 2**30, (levels[-1][2] - baseline_host) / 2**20
    assert not [line for line in log.lines if "memory leak" in line.lower()], log.lines


def test_switch_diffusion_model_on_the_compiled_model(nodes, compiled, second_file, sample):
    sample(compiled)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=second_file.name)[0]
    out, _ = sample(switched)
    assert dynamo_graph_count() == graphs and torch.isfinite(out).all()


def test_switch_diffusion_model_on_a_dynamic_vram_model_that_has_run(nodes, base, second_file, sample):
    sample(base)  # its layers now hold views of the virtual buffer their last call read (comfy/ops.py's _v_weight)
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(base, unet_name=second_file.name)[0]
    assert switched.is_dynamic() and switched.model is not base.model
    out, _ = sample(switched)
    assert torch.isfinite(out).all()
    assert torch.isfinite(sample(base)[0]).all()  # the input model still loads and runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_quantized_checkpoint_through_quantize_compile_and_switch(comfy, nodes, family, models_folder, sample,
                                                                     layout, caplog):
    """A file users download stored in 8 or 4 bits, on ComfyUI's default path: Quantize Model (its own defaults:
    layers timed against ComfyUI's stored layers) converts or keeps each, Compile Model runs it with CUDA graphs, and
    Switch Diffusion Model takes another file of the layout without recompiling."""
    import comfy.sd
    from overdrive.builtin_models.quantized import ensure_quantized_diffusion_model
    from overdrive.comfy_host.quantized_model import quantization_report

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    files = [ensure_quantized_diffusion_model(family, "tiny", seed, models_folder, layout) for seed in (0, 1)]
    loaded = comfy.sd.load_diffusion_model(str(files[0]))
    _, comfy_calls = sample(loaded)  # ComfyUI's own fp8 path on the file
    with caplog.at_level(logging.INFO, logger="overdrive"):
        quantized = nodes["OverdriveQuantizeModel"].execute(loaded, format="fp8_e4m3", calibration_steps=1, positive=conditioning(family, 1),
                                      negative=conditioning(family, 2),
                                      latent={"samples": empty_latent(family, RES, RES, FRAMES)})[0]
        both = nodes["OverdriveCompileModel"].execute(quantized)[0]
        error = assert_calls_match(sample(both)[1], comfy_calls, FP8_TOLERANCE)
        graphs = dynamo_graph_count()
        switched = nodes["OverdriveSwitchDiffusionModel"].execute(both, unet_name=files[1].name)[0]
        out, _ = sample(switched)
    assert quantization_report(quantized) is not None, caplog.text[-3000:]
    assert dynamo_graph_count() == graphs and torch.isfinite(out).all()
    assert "runs without a CUDA graph" not in caplog.text and "failed" not in caplog.text, caplog.text[-3000:]
    converted = [line for line in caplog.text.splitlines() if "this checkpoint stores quantized, " in line]
    assert len(converted) == 1, caplog.text[-3000:]  # one summary line: what was converted, what kept
    log.info("%s %s on dynamic VRAM: %s; compiled per-call error %.2e against ComfyUI's own path", family, layout,
             converted[0].split("Overdrive quantization: ")[-1], error)
