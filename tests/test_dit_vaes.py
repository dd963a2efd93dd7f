"""Compile VAE on the DiT families' own VAEs (CPU, the built-in fixed-seed weights in ComfyUI's VAE class): Flux's
(also SD3.5's and Z-Image's) 16-channel autoencoder decodes like eager, compiled (not fallen back), and tiled decoding
keeps working through the compiled decode; Wan 2.2's causal video VAE, which ran slower compiled, passes through
eager with the reason logged."""
import logging

import pytest
import torch

from overdrive.builtin_models.dit import empty_latent
from overdrive.compiler import CompiledMethod, dynamo_graph_count

TOLERANCE = 1e-4  # compiled vs eager, float32 on the CPU


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=["flux"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def vae(comfy, family):
    """Built in memory in float32, as VAELoader builds it from the built-in file (Wan 2.2's would be 2.8 GB on disk)."""
    from overdrive.runner.inprocess import build_family_vae
    return build_family_vae(comfy, family)


def latent_for(family):
    shape = empty_latent(family, 64, 64, frames=5).shape  # Wan 2.2: 2 latent frames
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def test_compile_vae_decodes_the_family_vae_like_eager(nodes, vae, family):
    latent = latent_for(family)
    expected = vae.decode(latent)
    compiled_vae = nodes["OverdriveCompileVAE"]().compile(vae, cuda_graphs=False)[0]
    out = compiled_vae.decode(latent)
    decode = compiled_vae.patcher.object_patches["decode"]
    assert isinstance(decode, CompiledMethod)
    assert decode.graph.failure is None and decode.graph.graphs_compiled >= 1
    assert relative_error(out, expected) < TOLERANCE
    assert torch.equal(vae.decode(latent), expected)  # the input VAE is untouched


def test_tiled_decode_runs_through_the_compiled_decode(nodes, vae, family):
    latent = latent_for(family)
    tiles = dict(tile_x=6, tile_y=6, overlap=2)
    expected = vae.decode_tiled(latent, **tiles)
    compiled_vae = nodes["OverdriveCompileVAE"]().compile(vae, cuda_graphs=False)[0]
    assert relative_error(compiled_vae.decode_tiled(latent, **tiles), expected) < TOLERANCE
    assert compiled_vae.patcher.object_patches["decode"].graph.failure is None


def test_wan_video_vae_passes_through_eager_with_the_reason_logged(nodes, comfy, caplog):
    from overdrive.runner.inprocess import build_family_vae
    vae = build_family_vae(comfy, "wan22")
    latent = latent_for("wan22")
    expected = vae.decode(latent)
    before = dynamo_graph_count()
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        returned = nodes["OverdriveCompileVAE"]().compile(vae)[0]
    assert returned is vae and not vae.patcher.object_patches
    assert any("stays eager" in r.getMessage() for r in caplog.records)
    assert torch.equal(returned.decode(latent), expected) and dynamo_graph_count() == before


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODE_CLASS_MAPPINGS
    return NODE_CLASS_MAPPINGS
