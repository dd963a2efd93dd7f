"""LTX-2 (ComfyUI's LTXAV: video and audio in one model) under Overdrive's nodes, on the CPU: it has no family
plug-in (its blocks take and return a (video, audio) tuple), so Compile Model compiles it whole, DeepCache returns it
unchanged with a warning, and Quantize Model calibrates on its audio-video latent. None of them may fail a
generation. The model is ComfyUI's own class at a tiny configuration of the layout its detection reads (built in
process: the built-in files have no LTX-2, whose empty audio latent needs an audio VAE), sampled by ComfyUI's sampler on
a latent made as LTXV Concat AV Latent makes it; fidelity is checked per model call against eager."""
import logging

import pytest
import torch

PER_CALL_TOLERANCE = 1e-4  # compiled vs eager, float32 on the CPU
QUANTIZED_TOLERANCE = 0.1  # int8 vs float per model call (tiny random model)
STEPS, CFG = 2, 3.0
# Detection's config for LTXAV (comfy/model_detection.py reads depth and widths from the weights and the rest from the
# file's metadata), at a few hundred thousand parameters.
TINY_LTXAV = dict(image_model="ltxav", num_layers=2, attention_head_dim=4, cross_attention_dim=128, in_channels=128,
                  audio_in_channels=128, audio_attention_head_dim=4, audio_num_attention_heads=2,
                  audio_cross_attention_dim=8, caption_channels=16)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def parts(value) -> list:
    """The tensors of a latent: LTX-2's is nested (video, audio). (A model call's output reaches ComfyUI's wrapper packed
    into one tensor: both parts, flattened.)"""
    return list(value.unbind()) if getattr(value, "is_nested", False) else [value]


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODE_CLASS_MAPPINGS
    return NODE_CLASS_MAPPINGS


@pytest.fixture(scope="module")
def base(comfy):
    import comfy.model_detection
    import comfy.model_patcher

    config = comfy.model_detection.model_config_from_unet_config(dict(TINY_LTXAV))
    assert type(config).__name__ == "LTXAV"
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "", device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.diffusion_model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@pytest.fixture(scope="module")
def latent(comfy):
    """Video (1, 128, 2 frames, 4, 4) and audio (1, 8 channels, 5 latents, 16 bins), as LTXVConcatAVLatent packs them."""
    import comfy.nested_tensor
    return comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, 2, 4, 4), torch.zeros(1, 8, 5, 16)))


def conditioning(seed):
    """The text encoder's output for LTX-2: video and audio context side by side (the model splits it in half)."""
    return [[torch.randn(1, 8, 2 * TINY_LTXAV["caption_channels"], generator=torch.Generator().manual_seed(seed)), {}]]


@pytest.fixture(scope="module")
def sample(comfy, latent):
    import comfy.sample

    def run(model):
        calls = []

        def wrapper(apply_model, args):
            out = apply_model(args["input"], args["timestep"], **args["c"])
            calls.append([t.detach().clone() for t in parts(out)])
            return out
        recorded = model.clone()
        recorded.set_model_unet_function_wrapper(wrapper)
        noise = comfy.sample.prepare_noise(latent, 7)
        out = comfy.sample.sample(recorded, noise, STEPS, CFG, "euler", "simple", conditioning(1), conditioning(2),
                                  latent, seed=7, disable_pbar=True)
        return parts(out), calls
    return run


@pytest.fixture(scope="module")
def eager(base, sample):
    return sample(base.clone())


def assert_calls_match(calls, reference_calls, tolerance) -> float:
    assert len(calls) == len(reference_calls) > 0
    errors = [relative_error(out, ref) for call, reference in zip(calls, reference_calls)
              for out, ref in zip(call, reference)]
    assert max(errors) < tolerance, errors
    return max(errors)


def test_the_model_is_ltx2_with_audio_and_no_family_plug_in(base, eager):
    from overdrive.families import family_of

    assert type(base.model.diffusion_model).__name__ == "LTXAVModel"
    assert family_of(base.model.diffusion_model) is None
    video, audio = eager[0]
    assert video.shape == (1, 128, 2, 4, 4) and audio.shape == (1, 8, 5, 16)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in (video, audio))
    packed, = eager[1][0]  # the first call's output: cond and uncond, video and audio
    assert packed.numel() == 2 * (video.numel() + audio.numel())


def test_compile_model_compiles_it_whole_and_matches_eager_per_call(nodes, base, sample, eager):
    compiled = nodes["OverdriveCompileModel"]().compile(base)[0]
    assert "diffusion_model.forward" in compiled.object_patches
    assert_calls_match(sample(compiled)[1], eager[1], PER_CALL_TOLERANCE)


def test_deepcache_returns_it_unchanged_and_says_why(nodes, base, sample, eager, caplog):
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        cached = nodes["OverdriveDeepCache"]().patch(base)[0]
    assert "LTXAVModel" in caplog.text and "returned unchanged" in caplog.text
    assert cached.object_patches == base.object_patches
    assert_calls_match(sample(cached)[1], eager[1], 1e-7)


def test_quantize_model_calibrates_on_the_audio_video_latent(nodes, base, latent, sample, eager, caplog):
    quantize = nodes["OverdriveQuantizeModel"]()
    with caplog.at_level(logging.INFO, logger="overdrive"):
        quantized = quantize.quantize(base, format="int8", compute_density_threshold=0.0, min_speedup=0.0,
                                      calibration_steps=1, positive=conditioning(1), negative=conditioning(2),
                                      latent={"samples": latent})[0]
    report = quantize.last_report
    assert report is not None and report.quantized, caplog.text  # None: quantizing failed and fell back
    assert "2 latent frames, 4x4 latent with a (8, 5, 16) latent" in caplog.text
    error = assert_calls_match(sample(quantized)[1], eager[1], QUANTIZED_TOLERANCE)
    logging.getLogger("overdrive").info("ltx2: %d layers int8, per-call error %.4f", len(report.quantized), error)


def test_quantize_model_names_the_latents_it_takes(nodes, base):
    with pytest.raises(ValueError, match="LTXV Concat AV Latent"):
        nodes["OverdriveQuantizeModel"]().quantize(base, format="int8", positive=conditioning(1),
                                                   negative=conditioning(2), latent={"samples": [1, 2]})
