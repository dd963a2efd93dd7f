"""LTX-2 (ComfyUI's LTXAV: video and audio in one model): what tests/test_dit_families.py (which runs every node on
its built-in tiny file too) does not see. Its blocks take and return (video, audio) tuples (families/ltxv.py, `LTX2`),
its latent is LTXV Concat AV Latent's NestedTensor, and Quantize Model calibrates on that latent and keeps both streams'
prompt-only projections in float. The main job's video-only graph for it runs through a real ComfyUI server."""
import logging
import re

import pytest
import torch

# The DiT families' fixtures (the built-in files, the loaded model, its sampler, eager's calls) and helpers, here for
# LTX-2 through this module's `family`.
from test_dit_families import (QUANTIZED_TOLERANCE, assert_calls_match, base, eager, first_file,  # noqa: F401
                               models_folder, nodes, sample)

from overdrive.builtin_models.dit import conditioning, empty_latent


@pytest.fixture(scope="module")
def family():
    return "ltx2"


def test_the_file_loads_as_ltx2_and_its_plug_in_sees_both_streams(base, family, eager):
    from overdrive.families import family_of

    assert type(base.model.diffusion_model).__name__ == "LTXAVModel"
    # The audio stream's widths came from the file's metadata (the weights' shapes give only the video's).
    assert base.model.diffusion_model.audio_inner_dim == 8
    stack, = family_of(base.model.diffusion_model).stacks
    assert stack.returned == ("video", "audio") and stack.probed == "video"
    video, audio = empty_latent(family, 64, 64, 5).unbind()
    assert video.shape == (1, 128, 1, 2, 2) and audio.shape == (1, 8, 5, 16)
    out, calls = eager
    assert out.numel() == video.numel() + audio.numel() and torch.isfinite(out).all() and out.abs().sum() > 0
    _, _, packed = calls[0]  # ComfyUI's wrapper sees cond and uncond, video and audio, packed into one tensor
    assert packed.numel() == 2 * out.numel()


def test_quantize_model_calibrates_on_the_audio_video_latent(nodes, base, family, sample, eager, caplog):
    from overdrive.families import family_of

    # Two calibration steps: not the decisions test_dit_families caches for this model (it checks a first run's).
    from overdrive.comfy_host.quantized_model import quantization_report

    with caplog.at_level(logging.INFO, logger="overdrive"):
        quantized = nodes["OverdriveQuantizeModel"].execute(base, format="int8", compute_density_threshold=0.0, min_speedup=0.0,
                                      calibration_steps=2, positive=conditioning(family, 1),
                                      negative=conditioning(family, 2),
                                      latent={"samples": empty_latent(family, 64, 64, 5)})[0]
    report = quantization_report(quantized)
    assert report is not None and report.quantized, caplog.text  # None: quantizing failed and fell back
    assert "1 latent frames, 2x2 latent with a (8, 5, 16) latent" in caplog.text
    # The prompt-only layers of both streams (caption projections, cross-attention keys and values) stay float.
    float_layers = dict(family_of(base.model.diffusion_model).float_layers)
    kept = {layer.name for layer in report.layers if any(re.match(p, layer.name) for p in float_layers)}
    assert {"audio_caption_projection.linear_1", "transformer_blocks.0.audio_attn2.to_k",
            "transformer_blocks.1.attn2.to_v"} <= kept
    error = assert_calls_match(sample(quantized)[1], eager[1], QUANTIZED_TOLERANCE)
    logging.getLogger("overdrive").info("ltx2: %d layers int8, per-call error %.4f", len(report.quantized), error)


def test_quantize_model_names_the_latents_it_takes(nodes, base, family):
    with pytest.raises(ValueError, match="LTXV Concat AV Latent"):
        nodes["OverdriveQuantizeModel"].execute(base, format="int8", positive=conditioning(family, 1),
                                                   negative=conditioning(family, 2), latent={"samples": [1, 2]})


def test_the_video_only_workflow_runs_through_the_server_as_eager_does(client, server):
    """`run_main.py --arch ltx2`'s graph (LTX-Video's workflow with LTX-2's files, an empty audio stream) queued over
    ComfyUI's HTTP API: Compile Model's final latent is eager's."""
    from test_server import TOLERANCE, latent_of, relative_error, small, with_latent_output

    from overdrive.harness.workflows import dit_workflow, without_overdrive

    workflow = small(dit_workflow("ltx2"))
    eager = client.run(with_latent_output(without_overdrive(workflow), "ltx2-eager"))
    compiled = client.run(with_latent_output(workflow, "ltx2-compiled"))
    reference, out = latent_of(eager, server), latent_of(compiled, server)
    assert out.shape == (1, 128, 1, 2, 2) and torch.isfinite(out).all()
    assert relative_error(out, reference) < TOLERANCE
    assert "Overdrive compiled BasicAVTransformerBlock" in server.log_text()
