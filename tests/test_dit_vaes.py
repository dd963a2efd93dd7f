"""Compile VAE on the DiT families' own VAEs (CPU, the built-in fixed-seed weights in ComfyUI's VAE class): Flux's (also
SD3.5's and Z-Image's) 16-channel autoencoder and Flux.2's (32 channels, patchified and batch-normalised to 128) decode
like eager, compiled (not fallen back), and tiled decoding keeps working through the compiled decode; Wan 2.2's causal
video VAE, which ran slower compiled, runs eager with channels-last convolutions and the reason logged."""
import logging

import pytest
import torch

from overdrive.builtin_models.dit import empty_latent
from overdrive.compiler import CompiledMethod, dynamo_graph_count

TOLERANCE = 1e-4  # compiled vs eager, float32 on the CPU


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=["flux", "flux2"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def vae(comfy, family):
    """Built in memory in float32, as VAELoader builds it from the built-in file (Wan 2.2's would be 2.8 GB on disk)."""
    from overdrive.harness.inprocess import build_family_vae
    return build_family_vae(comfy, family)


def latent_for(family):
    shape = empty_latent(family, 64, 64, frames=5).shape  # Wan 2.2: 2 latent frames
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def test_compile_vae_decodes_the_family_vae_like_eager(nodes, vae, family):
    latent = latent_for(family)
    expected = vae.decode(latent)
    compiled_vae = nodes["OverdriveCompileVAE"].execute(vae, cuda_graphs=False)[0]
    out = compiled_vae.decode(latent)
    decode = compiled_vae.patcher.object_patches["decode"]
    assert isinstance(decode, CompiledMethod)
    assert decode.graph.failure is None and decode.graph.graphs_compiled >= 1
    assert relative_error(out, expected) < TOLERANCE
    assert torch.equal(vae.decode(latent), expected)  # the input VAE is untouched


def test_tiled_decode_runs_through_the_compiled_decode(nodes, vae, family):
    if family != "flux":
        pytest.skip("ComfyUI's tiling around a compiled decode is the same for every VAE: Flux's covers it")
    latent = latent_for(family)
    tiles = dict(tile_x=6, tile_y=6, overlap=2)
    expected = vae.decode_tiled(latent, **tiles)
    compiled_vae = nodes["OverdriveCompileVAE"].execute(vae, cuda_graphs=False)[0]
    assert relative_error(compiled_vae.decode_tiled(latent, **tiles), expected) < TOLERANCE
    assert compiled_vae.patcher.object_patches["decode"].graph.failure is None


def test_wan_video_vae_runs_eager_with_channels_last_convolutions(nodes, comfy, caplog):
    """Wan's causal video VAE decoded slower compiled; Compile VAE gives its 3-D convolutions the
    channels-last layout instead (faster there), compiles nothing, and says so in the log."""
    from overdrive.harness.inprocess import build_family_vae
    vae = build_family_vae(comfy, "wan22")
    latent = latent_for("wan22")
    expected = vae.decode(latent)
    before = dynamo_graph_count()
    with caplog.at_level(logging.INFO, logger="overdrive"):
        returned = nodes["OverdriveCompileVAE"].execute(vae)[0]
    assert returned is vae and not vae.patcher.object_patches
    assert any("channels_last_3d" in r.getMessage() for r in caplog.records)
    convs = [m for m in vae.first_stage_model.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last_3d) for c in convs)
    assert relative_error(returned.decode(latent), expected) < TOLERANCE and dynamo_graph_count() == before


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODES
    return NODES
