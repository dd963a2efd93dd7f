"""Compile Model's side of ComfyUI's dynamic VRAM that runs without a GPU: the classic loader's model it switches to
has its layers' weights in the dtypes they were built for. The dynamic-VRAM paths themselves need an NVIDIA GPU
(comfy-aimdo): tests/test_dynamic_vram_gpu.py."""
import contextlib
import gc
import weakref

import pytest
import torch

from overdrive.builtin_models.dit import ensure_diffusion_model
from test_dit_families import sampler


@contextlib.contextmanager
def fp16_inference_with_dynamic_vram_on(comfy):
    """The process as main.py sets it up on an NVIDIA GPU (comfy-aimdo enabled), with ComfyUI's fp16 inference (its
    choice for Wan on an H200)."""
    import comfy.cli_args
    import comfy.memory_management
    before = comfy.memory_management.aimdo_enabled, comfy.cli_args.args.fp16_unet
    comfy.memory_management.aimdo_enabled, comfy.cli_args.args.fp16_unet = True, True
    try:
        yield
    finally:
        comfy.memory_management.aimdo_enabled, comfy.cli_args.args.fp16_unet = before


def mismatched(module):
    return [f"{name}.{kind}" for name, layer in module.named_modules() for kind in ("weight", "bias")
            if getattr(layer, f"{kind}_comfy_model_dtype", None) is not None
            and layer._parameters.get(kind) is not None
            and layer._parameters[kind].dtype != getattr(layer, f"{kind}_comfy_model_dtype")]


def test_the_classic_loaders_model_gets_its_layers_dtypes(comfy, tmp_path):
    import comfy.sd
    from overdrive.comfy_host.dynamic_vram import cast_to_layer_dtypes_

    import comfy.utils

    # bf16 weights, read as ComfyUI reads them without comfy-aimdo's file mapping (it needs a GPU)
    state, metadata = comfy.utils.load_torch_file(str(ensure_diffusion_model("wan22", "tiny", 0, tmp_path)),
                                                  return_metadata=True)
    with fp16_inference_with_dynamic_vram_on(comfy):
        classic = comfy.sd.load_diffusion_model_state_dict(state, metadata=metadata, disable_dynamic=True)
    module = classic.model.diffusion_model
    before = mismatched(module)
    assert before, "ComfyUI cast the file's weights itself: the cast is no longer needed"
    assert cast_to_layer_dtypes_(classic.model) == len(before)
    assert not mismatched(module)
    assert module.time_embedding[0].weight.dtype == torch.float16
    assert module.patch_embedding.weight.dtype == torch.float32  # built in float32 by Wan's code, and kept so


def test_compile_clone_of_a_classic_model_is_a_plain_clone(comfy, tmp_path):
    import comfy.sd
    from overdrive.comfy_host.dynamic_vram import compile_clone

    model = comfy.sd.load_diffusion_model(str(ensure_diffusion_model("wan22", "tiny", 0, tmp_path)))
    clone, reloaded = compile_clone(model)
    assert not reloaded and clone.model is model.model and clone is not model


def test_the_classic_copy_outlives_a_dropped_compile_output_and_goes_with_its_file(comfy, tmp_path):
    """ComfyUI drops the last prompt's Compile Model output before the node runs again (a LoRA or strength change):
    the next classic clone runs the same copy, whose module keeps the CUDA graphs and step decisions. The newest clone
    stays kept until a newer one has loaded, and all of it goes with the file's model, by reference count."""
    import comfy.model_management
    import comfy.sd
    from overdrive.comfy_host.model_copies import CLASSIC_KEPT, classic_clone

    gc.collect()
    gc.disable()
    try:
        sample = sampler("flux")
        model = comfy.sd.load_diffusion_model(str(ensure_diffusion_model("flux", "tiny", 0, tmp_path)))
        first = classic_clone(model.clone())
        twin = weakref.ref(first.model)
        sample(first)
        del first  # the cache's output of the last prompt
        second = classic_clone(model.clone())
        assert second.model is twin()
        assert len(getattr(model.model, CLASSIC_KEPT)) == 2  # the loaded one until the newer one runs
        sample(second)
        assert getattr(model.model, CLASSIC_KEPT) == [second]
        comfy.model_management.unload_all_models()
        file_model = weakref.ref(model.model)
        del model, second
        assert file_model() is None and twin() is None
    finally:
        gc.enable()


def test_the_gpu_budget_is_the_reserve_or_the_memory_fraction_whichever_is_lower(comfy, monkeypatch):
    """A 16 GiB card emulated on a 141 GiB GPU sets both (harness/inprocess.py reserve_beyond_budget): the budget is
    16 GiB, not 16 less the 125 reserved. On a real card only the reserve applies. No GPU here, so the card's figures
    are given."""
    import comfy.model_management as mm
    from overdrive.comfy_host.gpu_budget import gpu_budget_bytes
    gib, card = 2**30, torch.device("cuda", 0)
    monkeypatch.setattr(mm, "get_total_memory", lambda device=None, torch_total_too=False: 141 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Card", (), {"total_memory": 141 * gib}))
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 125 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 16 / 141, raising=False)
    assert gpu_budget_bytes(card) == 16 * gib
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 1 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert gpu_budget_bytes(card) == 140 * gib


def test_a_quantized_model_too_large_for_the_card_compiles_with_its_quantized_layers_streamed(comfy, tmp_path):
    """Compile Model takes ComfyUI's classic loader for a quantized model whose float part (norms, embeddings) fits the
    card with the working memory even where its quantized layers do not all fit: Overdrive streams those block by
    block, and compiled blocks run through them. A float model that does not fit keeps dynamic VRAM."""
    import comfy.sd
    from overdrive.comfy_host.dynamic_vram import streams_quantized_layers, with_workspace
    from overdrive.comfy_host.quantize_patches import install_quantized, resident_bytes
    from overdrive.comfy_host.quantized_lora import SidePaths
    from overdrive.comfy_host.quantized_sets import QuantizedSet
    from overdrive.comfy_host.quantized_streaming import tensor_bytes
    from overdrive.quantization import Int8Linear

    model = comfy.sd.load_diffusion_model(str(ensure_diffusion_model("flux", "tiny", 0, tmp_path)))
    assert not streams_quantized_layers(model, 2**50)  # nothing of Overdrive's to stream
    quantized = model.clone()
    tree = quantized.model.diffusion_model
    eight_bit = {name: Int8Linear.from_float(layer) for name, layer in tree.named_modules()
                 if isinstance(layer, torch.nn.Linear) and name.startswith("double_blocks.")}
    install_quantized(quantized, QuantizedSet(eight_bit, None, SidePaths(eight_bit, torch.float32)), eight_bit)
    layers = [module for key, module in quantized.object_patches.items() if hasattr(module, "load_float_weight")]
    float_part = with_workspace(resident_bytes(quantized) - sum(tensor_bytes(layer) for layer in layers))
    assert streams_quantized_layers(quantized, float_part)
    assert not streams_quantized_layers(quantized, float_part - 1)


def test_a_float_model_too_large_for_the_card_is_told_that_8_bits_would_fit(comfy, tmp_path):
    """Compile Model's log on a card the float model does not fit: where its linear weights in 8 bits would fit with
    the working memory, it says to put Quantize Model first (fp8 Flux fits a 16 GiB card; bf16 does not)."""
    import comfy.sd
    from overdrive.comfy_host.dynamic_vram import eight_bit_bytes, quantize_first_hint, with_workspace

    model = comfy.sd.load_diffusion_model(str(ensure_diffusion_model("flux", "tiny", 0, tmp_path)))
    linears = [m.weight for m in model.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(w.element_size() > 1 for w in linears)
    assert model.model_size() - eight_bit_bytes(model) == sum(w.numel() * (w.element_size() - 1) for w in linears)
    fits_8_bit = with_workspace(eight_bit_bytes(model)) / 2**30
    assert "put Quantize Model before Compile Model" in quantize_first_hint(model, fits_8_bit + 0.01)
    assert quantize_first_hint(model, fits_8_bit - 0.01) == ""
