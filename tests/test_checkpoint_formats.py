"""The quantized checkpoint layouts users download (fp8 "scaled", fp8 "mixed"), as built-in tiny Flux.1 files made with
ComfyUI's own fp8 layout class and loaded by its own loader (Load Diffusion Model's path), through Overdrive's nodes on
the CPU: Quantize Model says what the checkpoint already stores and changes nothing it cannot convert; Compile Model
and the step cache run over ComfyUI's quantized layers and match them per model call."""
import logging

import pytest
import torch

from overdrive.builtin_models.dit import MODULATION
from overdrive.builtin_models.quantized import BLOCK_LINEAR, LAYOUTS, ensure_quantized_diffusion_model
from test_dit_families import assert_calls_match, models_folder, nodes, sample  # noqa: F401

PER_CALL_TOLERANCE = 1e-3  # compiled vs eager over the same fp8 weights, float32 compute on the CPU


@pytest.fixture(scope="module")
def family():
    return "flux"


@pytest.fixture(scope="module", params=LAYOUTS)
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
    from overdrive.nodes.checkpoint_formats import mixed_precision_float_layers, stored_formats

    stored = stored_formats(model.model.diffusion_model)
    assert stored and set(stored.values()) == {"float8_e4m3fn"}
    assert all(isinstance(model.model.diffusion_model.get_submodule(name).weight, QuantizedTensor) for name in stored)
    # the mixed file keeps the blocks' modulation layers in bf16 beside the e4m3 ones; the scaled file stores them too
    floats = mixed_precision_float_layers(model.model.diffusion_model, stored)
    modulation = [name for name in [*stored, *floats] if BLOCK_LINEAR.search(name) and MODULATION.search(name)]
    assert modulation and set(modulation) <= set(floats if layout == "fp8_mixed" else stored), modulation


def test_quantize_model_says_what_the_checkpoint_stores_and_leaves_it_as_loaded(nodes, family, model, sample, eager,
                                                                               caplog):
    from test_dit_families import quantize_every_layer

    with caplog.at_level(logging.INFO, logger="overdrive"):
        quantize, quantized = quantize_every_layer(nodes, model, family, "fp8_e4m3")
    assert "this checkpoint stores" in caplog.text and "in float8_e4m3fn" in caplog.text, caplog.text[-2000:]
    assert "no layer of this checkpoint to convert" in caplog.text
    assert "quantizing failed" not in caplog.text and quantize.last_report is None
    out, calls = sample(quantized)
    assert torch.equal(out, eager[0])


def test_compile_model_and_the_step_cache_run_over_comfyuis_quantized_layers(nodes, model, layout, sample, eager,
                                                                           caplog):
    if layout != "fp8_mixed":
        pytest.skip("the mixed file has both kinds of layers; one compile of them keeps the CPU suite short")
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        compiled = nodes["OverdriveCompileModel"]().compile(model)[0]
        out, calls = sample(compiled)
        cached = nodes["OverdriveDeepCache"]().patch(compiled, cache_interval=2)[0]
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
    compiled = nodes["OverdriveCompileModel"]().compile(model)[0] if layout == "fp8_mixed" else model.clone()
    before, _ = sample(compiled)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"]().switch(compiled, unet_name=other.name)[0]
    _, calls = sample(switched)
    assert dynamo_graph_count() == graphs  # the same compiled blocks
    _, expected = sample(comfy.sd.load_diffusion_model(str(other)))
    assert_calls_match(calls, expected, PER_CALL_TOLERANCE)
    assert torch.equal(sample(compiled)[0], before)  # the running model keeps its own weights
    bf16 = models_folder / other.name.replace(f"-{layout}", "")  # the same weights, not stored quantized
    with pytest.raises(WeightMismatchError, match="left unchanged"):
        nodes["OverdriveSwitchDiffusionModel"]().switch(compiled, unet_name=bf16.name)
