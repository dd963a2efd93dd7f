"""LTX-2 (ComfyUI's LTXAV: video and audio in one model) under every Overdrive node, on the CPU: its blocks take and
return (video, audio) tuples (families/ltxv.py, `LTX2`), and the nodes must see both streams through compiled blocks,
the step cache and calibration on its audio-video latent. The model is ComfyUI's own class at a tiny configuration of
the layout its detection reads (built in process: the built-in files have no LTX-2, whose empty audio latent needs an
audio VAE), sampled by ComfyUI's sampler on a latent made as LTXV Concat AV Latent makes it; fidelity is checked per
model call against eager."""
import logging

import pytest
import torch

# The DiT families' helpers: ComfyUI's wrapper sees LTX-2's model calls with video and audio packed into one tensor, so
# a call is recorded and compared as any family's.
from test_dit_families import (QUANTIZED_TOLERANCE, assert_calls_match, compiled, distinct_blocks,  # noqa: F401
                               nodes, record_calls, relative_error)

PER_CALL_TOLERANCE = 1e-4  # compiled vs eager, float32 on the CPU (tests/test_ltx2_gpu.py: bf16 on a GPU)
STEPS, CFG = 2, 3.0
# Detection's config for LTXAV (comfy/model_detection.py reads depth and widths from the weights and the rest from the
# file's metadata), at a few hundred thousand parameters.
TINY_LTXAV = dict(image_model="ltxav", num_layers=2, attention_head_dim=4, cross_attention_dim=128, in_channels=128,
                  audio_in_channels=128, audio_attention_head_dim=4, audio_num_attention_heads=2,
                  audio_cross_attention_dim=8, caption_channels=16)


def parts(value) -> list:
    """The tensors of a sampled latent: LTX-2's is nested (video, audio)."""
    return list(value.unbind()) if getattr(value, "is_nested", False) else [value]


@pytest.fixture(scope="module")
def device():
    return torch.device("cpu"), torch.float32  # where the model runs, in what dtype


@pytest.fixture(scope="module")
def per_call_tolerance():
    return PER_CALL_TOLERANCE


@pytest.fixture(scope="module")
def base(comfy, device):
    import comfy.model_detection
    import comfy.model_patcher

    load_device, dtype = device
    config = comfy.model_detection.model_config_from_unet_config(dict(TINY_LTXAV))
    assert type(config).__name__ == "LTXAV"
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, "", device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.diffusion_model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=torch.device("cpu"))


@pytest.fixture(scope="module")
def latent(comfy):
    """Video (1, 128, 2 frames, 4, 4) and audio (1, 8 channels, 5 latents, 16 bins), packed as LTXVConcatAVLatent
    packs them."""
    import comfy.nested_tensor
    return comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, 2, 4, 4), torch.zeros(1, 8, 5, 16)))


def conditioning(seed):
    """The text encoder's output for LTX-2: video and audio context side by side (the model splits it in half)."""
    return [[torch.randn(1, 8, 2 * TINY_LTXAV["caption_channels"], generator=torch.Generator().manual_seed(seed)), {}]]


@pytest.fixture(scope="module")
def sample(comfy, latent):
    import comfy.sample

    def run(model):
        recorded, calls = record_calls(model)
        noise = comfy.sample.prepare_noise(latent, 7)
        out = comfy.sample.sample(recorded, noise, STEPS, CFG, "euler", "simple", conditioning(1), conditioning(2),
                                  latent, seed=7, disable_pbar=True)
        return parts(out), calls
    return run


@pytest.fixture(scope="module")
def eager(base, sample):
    return sample(base.clone())


def test_the_model_is_ltx2_and_its_plug_in_sees_both_streams(base, eager):
    from overdrive.families import family_of

    assert type(base.model.diffusion_model).__name__ == "LTXAVModel"
    stack, = family_of(base.model.diffusion_model).stacks
    assert stack.returned == ("video", "audio") and stack.probed == "video"
    video, audio = eager[0]
    assert video.shape == (1, 128, 2, 4, 4) and audio.shape == (1, 8, 5, 16)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in (video, audio))
    _, _, packed = eager[1][0]  # the first call's output: cond and uncond, video and audio
    assert packed.numel() == 2 * (video.numel() + audio.numel())


def test_compile_model_compiles_the_block_once_and_matches_eager_per_call(compiled, sample, eager, per_call_tolerance):
    from overdrive.compiler import dynamo_graph_count

    graphs = dynamo_graph_count()
    _, calls = sample(compiled)
    assert distinct_blocks(compiled) == 1
    assert dynamo_graph_count() - graphs <= 2
    assert_calls_match(calls, eager[1], per_call_tolerance)
    graphs = dynamo_graph_count()
    sample(compiled)
    assert dynamo_graph_count() == graphs  # warm: no recompile


def test_step_cache_reuses_both_streams_and_is_exact_on_full_steps(nodes, base, compiled, sample, eager, caplog,
                                                                     per_call_tolerance):
    with caplog.at_level(logging.INFO, logger="overdrive"):
        cached = nodes["OverdriveDeepCache"]().patch(base, cache_interval=2)[0]
        out, calls = sample(cached)  # step 0 full, step 1 reused
        again, _ = sample(cached)
    assert_calls_match(calls[:1], eager[1][:1], 1e-6)
    reused = relative_error(calls[1][2], eager[1][1][2])
    assert 1e-4 < reused < 0.5, reused  # an approximation of the full step, not the full step
    assert "1 full / 1 shallow" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(out, again))  # the second run reused nothing of the first
    on_compiled = nodes["OverdriveDeepCache"]().patch(compiled, cache_interval=2)[0]
    assert_calls_match(sample(on_compiled)[1], calls, per_call_tolerance)


def test_quantize_model_calibrates_on_the_audio_video_latent(nodes, base, latent, sample, eager, caplog):
    import re

    from overdrive.families import family_of

    quantize = nodes["OverdriveQuantizeModel"]()
    with caplog.at_level(logging.INFO, logger="overdrive"):
        quantized = quantize.quantize(base, format="int8", compute_density_threshold=0.0, min_speedup=0.0,
                                      calibration_steps=1, positive=conditioning(1), negative=conditioning(2),
                                      latent={"samples": latent})[0]
    report = quantize.last_report
    assert report is not None and report.quantized, caplog.text  # None: quantizing failed and fell back
    assert "2 latent frames, 4x4 latent with a (8, 5, 16) latent" in caplog.text
    # The prompt-only layers of both streams (caption projections, cross-attention keys and values) stay float.
    float_layers = dict(family_of(base.model.diffusion_model).float_layers)
    kept = {layer.name for layer in report.layers if any(re.match(p, layer.name) for p in float_layers)}
    assert {"audio_caption_projection.linear_1", "transformer_blocks.0.audio_attn2.to_k",
            "transformer_blocks.1.attn2.to_v"} <= kept
    error = assert_calls_match(sample(quantized)[1], eager[1], QUANTIZED_TOLERANCE)
    logging.getLogger("overdrive").info("ltx2: %d layers int8, per-call error %.4f", len(report.quantized), error)


def test_quantize_model_names_the_latents_it_takes(nodes, base):
    with pytest.raises(ValueError, match="LTXV Concat AV Latent"):
        nodes["OverdriveQuantizeModel"]().quantize(base, format="int8", positive=conditioning(1),
                                                   negative=conditioning(2), latent={"samples": [1, 2]})
