"""The quantized checkpoint layouts users download (fp8 "scaled", fp8 "mixed", int8 convrot, nvfp4), as built-in tiny
SD3.5 files made with ComfyUI's own quantized-tensor classes and loaded by its own loader (Load Diffusion Model's path),
through Overdrive's nodes on the CPU: Quantize Model says what the checkpoint already stores and converts it (the fp8
layouts bit for bit); Compile Model and the step cache run over ComfyUI's quantized layers and match them per model
call. Plain fp8 files (no scale) ComfyUI casts to float on the CPU; the GPU tests take them. SD3.5's is the smallest tiny file
with fused MLPs; Flux's (a width detection fixes) made these tests take 7 times as long, and runs on the GPU
(tests/test_dynamic_vram_gpu.py)."""
import logging

import pytest
import torch

from overdrive.builtin_models.dit import MODULATION
from overdrive.builtin_models.quantized import BLOCK_LINEAR, LAYOUTS, ensure_quantized_diffusion_model
from test_dit_families import QUANTIZED_TOLERANCE, assert_calls_match, models_folder, nodes, sample  # noqa: F401

PER_CALL_TOLERANCE = 1e-3  # compiled vs eager over the same fp8 weights, float32 compute on the CPU


@pytest.fixture(scope="module")
def family():
    return "sd35"


STORED_AS = {"fp8_scaled": "float8_e4m3fn", "fp8_mixed": "float8_e4m3fn", "int8_convrot": "int8_tensorwise",
             "nvfp4": "nvfp4"}  # the format ComfyUI's loader gives each layout's layers


@pytest.fixture(scope="module", params=[layout for layout in LAYOUTS if layout in STORED_AS])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def quantized_file(models_folder, family, layout):
    return ensure_quantized_diffusion_model(family, "tiny", 0, models_folder, layout)


@pytest.fixture(scope="module")
def model(comfy, quantized_file):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(quantized_file))


@pytest.fixture(scope="module")
def eager(model, sample):
    return sample(model.clone())


def test_comfyui_loads_the_file_with_its_quantized_layers(model, layout):
    from comfy.quant_ops import QuantizedTensor
    from overdrive.comfy_host.checkpoint_formats import stored_formats

    tree = model.model.diffusion_model
    stored = stored_formats(tree)
    assert stored and set(stored.values()) == {STORED_AS[layout]}
    assert all(isinstance(tree.get_submodule(name).weight, QuantizedTensor) for name in stored)
    # the mixed file keeps the blocks' modulation layers in bf16 beside the e4m3 ones; the scaled file stores them too
    modulation = [name for name, layer in tree.named_modules()
                  if BLOCK_LINEAR.search(name) and MODULATION.search(name) and hasattr(layer, "weight")]
    assert modulation and (set(modulation) <= set(stored)) == (layout != "fp8_mixed"), modulation


@pytest.fixture(scope="module")
def quantized(nodes, family, model):
    """Quantize Model (fp8, every layer whose error passes) on the file as ComfyUI loaded it: (its report, its model,
    what it logged)."""
    from test_dit_families import quantize_every_layer

    lines, handler, logger = [], logging.Handler(logging.INFO), logging.getLogger("overdrive")
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    try:
        return (*quantize_every_layer(nodes, model, family, "fp8_e4m3"), "\n".join(lines))
    finally:
        logger.removeHandler(handler), logger.setLevel(level)


def test_quantize_model_converts_the_stored_layers_and_says_so(model, layout, quantized, sample, eager):
    from overdrive.comfy_host.checkpoint_formats import stored_formats
    from overdrive.comfy_host.quantized_state import quantized_modules

    report, patched, logged = quantized
    stored = stored_formats(model.model.diffusion_model)
    assert report is not None and "quantizing failed" not in logged, logged[-2000:]
    assert f"this checkpoint stores {len(stored)} layer(s) quantized (" in logged
    assert (f"of the {len(stored)} layer(s) this checkpoint stores quantized, {len(stored)} now run Overdrive's "
            f"kernels ({len(stored)} in fp8_e4m3) and 0 keep ComfyUI's") in logged, logged
    layers = quantized_modules(patched)
    assert set(stored) <= set(layers)  # the float layers beside them too (every layer here: no speed rule)
    exact = STORED_AS[layout] == "float8_e4m3fn"  # one e4m3 weight with one scale in both: no weight bit changes
    for name in stored if exact else ():
        weight = model.model.diffusion_model.get_submodule(name).weight
        assert torch.equal(layers[name].weight_q.view(torch.uint8), weight._qdata.view(torch.uint8)), name
        assert torch.equal(layers[name].weight_scale.reshape(()), weight._params.scale.float().reshape(())), name
    _, calls = sample(patched)
    assert_calls_match(calls, eager[1], QUANTIZED_TOLERANCE)  # fp8 layouts: the inputs' e4m3 cast is what is left


def test_compile_model_and_the_step_cache_run_over_comfyuis_quantized_layers(nodes, model, layout, sample, eager,
                                                                           caplog):
    if layout != "fp8_mixed":
        pytest.skip("the mixed file has both kinds of layers; one compile of them keeps the CPU suite short")
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        compiled = nodes["OverdriveCompileModel"].execute(model)[0]
        out, calls = sample(compiled)
        cached = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
        cached_out, cached_calls = sample(cached)
    assert "failed" not in caplog.text, caplog.text[-2000:]  # no fallback to eager
    assert_calls_match(calls, eager[1], PER_CALL_TOLERANCE)
    assert_calls_match(cached_calls[:1], calls[:1], PER_CALL_TOLERANCE)  # the first step runs every block
    assert torch.isfinite(cached_out).all()


def test_switch_diffusion_model_takes_another_file_of_the_layout_without_recompiling(comfy, nodes, model, layout,
                                                                                     models_folder, family, sample):
    import comfy.sd
    from overdrive.compiler import WeightMismatchError, dynamo_graph_count

    other = ensure_quantized_diffusion_model(family, "tiny", 1, models_folder, layout)
    # Compiled for the mixed file (both kinds of layers); the scaled file's own conversion runs on the eager model,
    # which keeps the CPU suite short.
    compiled = nodes["OverdriveCompileModel"].execute(model)[0] if layout == "fp8_mixed" else model.clone()
    before, _ = sample(compiled)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=other.name)[0]
    _, calls = sample(switched)
    assert dynamo_graph_count() == graphs  # the same compiled blocks
    _, expected = sample(comfy.sd.load_diffusion_model(str(other)))
    assert_calls_match(calls, expected, PER_CALL_TOLERANCE)
    assert torch.equal(sample(compiled)[0], before)  # the running model keeps its own weights
    bf16 = models_folder / other.name.replace(f"-{layout}", "")  # the same weights, not stored quantized
    with pytest.raises(WeightMismatchError, match="left unchanged"):
        nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=bf16.name)


def test_switch_diffusion_model_converts_the_new_files_stored_layers_after_quantize_model(comfy, nodes, quantized,
                                                                                          layout, models_folder,
                                                                                          family, sample):
    import comfy.sd
    from overdrive.comfy_host.checkpoint_formats import stored_formats
    from overdrive.comfy_host.quantized_state import quantized_modules

    from overdrive.compiler import dynamo_graph_count

    if layout != "fp8_scaled":
        pytest.skip("the scaled file stores every block linear in fp8; one compiled switch keeps the CPU suite short")
    other = ensure_quantized_diffusion_model(family, "tiny", 1, models_folder, layout)
    _, patched, _ = quantized
    patched = nodes["OverdriveCompileModel"].execute(patched)[0]
    sample(patched)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(patched, unet_name=other.name)[0]
    expected = comfy.sd.load_diffusion_model(str(other))
    layers = quantized_modules(switched)
    for name in stored_formats(expected.model.diffusion_model):
        weight = expected.model.diffusion_model.get_submodule(name).weight
        assert torch.equal(layers[name].weight_q.view(torch.uint8), weight._qdata.view(torch.uint8)), name
    _, calls = sample(switched)
    assert dynamo_graph_count() == graphs  # the converted layers' blocks run the same compiled graphs
    assert_calls_match(calls, sample(expected)[1], QUANTIZED_TOLERANCE)


def test_weights_stored_in_fp8_without_a_scale_are_reported_and_read_in_16_bits(comfy):
    """What ComfyUI keeps of a plain fp8 file on the GPU (weights cast per call): Quantize Model lists those layers and
    measures them from their values in bf16 (few torch ops take fp8 operands)."""
    from overdrive.comfy_host.checkpoint_formats import stored_formats
    from overdrive.quantization.linear_layers import float_weight

    tree = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 16))
    tree[0].weight = torch.nn.Parameter(tree[0].weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    assert stored_formats(tree) == {"0": "float8_e4m3fn unscaled"}
    weight = float_weight(tree[0])
    assert weight.dtype == torch.bfloat16 and torch.equal(weight.float(), tree[0].weight.float())
    assert float_weight(tree[1]) is tree[1].weight


def test_an_int8_feed_forward_traced_by_torch_compile_computes_comfyuis_values(comfy, models_folder):
    """Wan's feed-forward calls comfy.ops.linear_input_act, whose fused INT8 quantizer (comfy-kitchen) Dynamo cannot
    trace on the GPU (it reads the CUDA stream's handle); while tracing, Overdrive's replacement runs the layer on the
    activation's output. Traced whole, it computes ComfyUI's values on the int8 convrot file's layers."""
    import comfy.ops
    import comfy.sd
    from comfy.quant_ops import QuantizedTensor
    from overdrive.comfy_host import traceable_ops

    tree = comfy.sd.load_diffusion_model(str(ensure_quantized_diffusion_model("wan22", "tiny", 0, models_folder,
                                                                              "int8_convrot"))).model.diffusion_model
    ffn = tree.blocks[0].ffn
    assert isinstance(ffn[2].weight, QuantizedTensor) and ffn[2].weight._layout_cls == "TensorWiseINT8Layout"
    x = torch.randn(1, 16, ffn[0].in_features)
    expected = ffn(x)  # ComfyUI's own function, eager
    traceable_ops.install()
    traceable_ops.install()  # idempotent: one wrapper over ComfyUI's function
    assert comfy.ops.linear_input_act.overdrive_replaces.__module__ == "comfy.ops"
    traced = torch.compile(ffn, fullgraph=True, backend="eager")(x)
    assert torch.allclose(traced, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(ffn(x), expected)  # eager calls keep ComfyUI's path


def test_switch_diffusion_model_after_quantize_and_compile_model_on_an_int8_wan_file(comfy, nodes, models_folder):
    """The int8 file's layers that stay ComfyUI's give their state dict a QuantizedTensor weight's stored parts, not the
    weight, whose wrapper cannot be deep-copied: the float view Switch Diffusion Model reads shares their parameters.
    The switched model computes the other file's values without recompiling."""
    import comfy.sd
    from overdrive.compiler import dynamo_graph_count
    from test_dit_families import FRAMES, RES, conditioning, empty_latent, sampler

    family = "wan22"
    files = [ensure_quantized_diffusion_model(family, "tiny", seed, models_folder, "int8_convrot") for seed in (0, 1)]
    run = sampler(family)
    loaded = comfy.sd.load_diffusion_model(str(files[0]))
    run(loaded)
    quantized = nodes["OverdriveQuantizeModel"].execute(
        loaded, format="fp8_e4m3", calibration_steps=1, positive=conditioning(family, 1),
        negative=conditioning(family, 2), latent={"samples": empty_latent(family, RES, RES, FRAMES)})[0]
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    run(both)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(both, unet_name=files[1].name)[0]
    _, calls = run(switched)
    assert dynamo_graph_count() == graphs
    assert_calls_match(calls, run(comfy.sd.load_diffusion_model(str(files[1])))[1], QUANTIZED_TOLERANCE)
