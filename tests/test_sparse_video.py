"""Sparse Video Attention: the frame mask against SDPA with the same mask written out, the FlexAttention path's
dense and sparse phases switched in place (what a CUDA graph replays), and the node on the built-in tiny Wan 2.2 file
loaded by ComfyUI's loader and sampled by its sampler, eager and compiled, on the CPU."""
import logging

import pytest
import torch
import torch.nn.functional as F

from overdrive.attention import video_sparsity
from overdrive.attention.video_sparsity import Plan, VideoSparsity, VideoSparsityError
from overdrive.builtin_models.dit import (conditioning, default_directory, empty_latent, ensure_diffusion_model,
                                          flat_latent)
from overdrive.step_cache.runner import relative_error

FRAMES, PER_FRAME, HEADS, DIM = 6, 40, 2, 16  # 240 tokens: two FlexAttention blocks, a partial one among them
VIDEO_FRAMES, RES, STEPS, CFG = 17, 64, 4, 3.0  # Wan 2.2: 5 latent frames of 2x2 tokens


def frame_window_mask(frames: int, per_frame: int, window: int, sink: int) -> torch.Tensor:
    """The mask written out token by token: the query's frame within `window` of the key's, or the key in the first
    `sink` frames."""
    tokens = frames * per_frame
    mask = torch.zeros(tokens, tokens, dtype=torch.bool)
    for query in range(tokens):
        for key in range(tokens):
            query_frame, key_frame = query // per_frame, key // per_frame
            mask[query, key] = abs(query_frame - key_frame) <= window or key_frame < sink
    return mask


def qkv(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, FRAMES * PER_FRAME, DIM, generator=generator) for _ in range(3)]


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test from the sparse phase with no plan made (a plan logs its density once)."""
    video_sparsity._PLANS.clear()
    video_sparsity._DENSE.clear()
    yield


def test_settings_out_of_range_name_the_setting():
    with pytest.raises(VideoSparsityError, match="window"):
        VideoSparsity(window=-1)
    with pytest.raises(VideoSparsityError, match="dense_steps"):
        VideoSparsity(dense_steps=1.5)


def test_the_op_masks_by_frame_distance_and_the_first_frames_and_runs_dense_in_the_dense_phase():
    q, k, v = qkv()
    sparsity = VideoSparsity(window=1, sink=1, dense_steps=0.5)
    mask = frame_window_mask(FRAMES, PER_FRAME, 1, 1)
    assert sparsity.density(FRAMES) == pytest.approx(float(mask.float().mean()))
    out = video_sparsity.video_attention(q, k, v, PER_FRAME, 1, 1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-5)
    assert relative_error(out, F.scaled_dot_product_attention(q, k, v).transpose(1, 2)) > 0.05  # it masks
    video_sparsity.set_dense(sparsity, True)
    dense = video_sparsity.video_attention(q, k, v, PER_FRAME, 1, 1)
    assert torch.allclose(dense, F.scaled_dot_product_attention(q, k, v).transpose(1, 2), atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_switches_phase_in_place_over_the_same_block_mask(compiled):
    """The CUDA path on the CPU: one BlockMask whose tables (and the flag its mask reads) are overwritten at a phase
    change, so a kernel compiled once, and a graph recorded over it, serve both phases."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = qkv(1)
    run = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    plan = Plan(VideoSparsity(window=1, sink=2), FRAMES * PER_FRAME, PER_FRAME, torch.device("cpu"))
    block_mask = plan.block_mask()
    sparse = F.scaled_dot_product_attention(q, k, v, attn_mask=frame_window_mask(FRAMES, PER_FRAME, 1, 2))
    dense = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(run(q, k, v, block_mask=block_mask), sparse, atol=1e-5)
    tables = [getattr(block_mask, name).data_ptr() for name in video_sparsity.TABLES]
    plan.set_dense(True)
    assert torch.allclose(run(q, k, v, block_mask=plan.block_mask()), dense, atol=1e-5)
    plan.set_dense(False)
    assert plan.block_mask() is block_mask and [getattr(block_mask, name).data_ptr()
                                                for name in video_sparsity.TABLES] == tables
    assert torch.allclose(run(q, k, v, block_mask=block_mask), sparse, atol=1e-5)


def test_a_short_clip_or_a_call_off_the_grid_stays_dense():
    q, k, _ = qkv()
    sparsity = VideoSparsity(window=1, sink=1)
    assert video_sparsity.applies(sparsity, q, k, (FRAMES, 5, 8)) == PER_FRAME
    assert video_sparsity.applies(sparsity, q, k, (3, 5, 8)) == 0  # not this call's tokens
    assert video_sparsity.applies(sparsity, q[:, :, :120], k[:, :, :120], (3, 5, 8)) == 0  # 3 frames: 7 of 9 pairs
    assert video_sparsity.applies(sparsity, q, k[:, :, :77], (FRAMES, 5, 8)) == 0  # cross-attention
    assert video_sparsity.applies(sparsity, q, k, None) == 0


@pytest.fixture(scope="module")
def wan(comfy):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(ensure_diffusion_model("wan22", "tiny", 0, default_directory())))


def sample(model):
    import comfy.sample
    latent = empty_latent("wan22", RES, RES, VIDEO_FRAMES)
    noise = comfy.sample.prepare_noise(latent, 7)
    out = comfy.sample.sample(model, noise, STEPS, CFG, "euler", "simple", conditioning("wan22", 1),
                              conditioning("wan22", 2), latent, seed=7, disable_pbar=True)
    return flat_latent(out)


def sparse(model, **settings):
    from overdrive.nodes import OverdriveSparseVideoAttention
    return OverdriveSparseVideoAttention.execute(model, **settings)[0]


def test_the_node_changes_a_wan_clip_only_in_its_sparse_steps(wan, caplog):
    eager = sample(wan)
    assert sparse(wan, dense_steps=1.0).model_options == wan.model_options  # every step dense: nothing installed
    assert relative_error(sample(sparse(wan, dense_steps=0.99)), eager) < 1e-5  # each of the 4 steps dense
    with caplog.at_level(logging.INFO, logger="overdrive"):
        late = sample(sparse(wan, dense_steps=0.5))
        always = sample(sparse(wan, dense_steps=0.0))
    assert "density 64%" in caplog.text, caplog.text[-2000:]
    assert 1e-5 < relative_error(late, eager) < relative_error(always, eager) < 0.5


def test_compile_model_before_or_after_runs_the_same_mask_without_a_graph_break(wan):
    from torch._dynamo.utils import counters

    from overdrive.nodes import OverdriveCompileModel
    expected = sample(sparse(wan, dense_steps=0.5))
    compile_model = OverdriveCompileModel.execute
    counters.clear()
    assert relative_error(sample(compile_model(sparse(wan, dense_steps=0.5))[0]), expected) < 1e-4
    assert relative_error(sample(sparse(compile_model(wan)[0], dense_steps=0.5)), expected) < 1e-4
    assert not counters["graph_break"], dict(counters["graph_break"])  # the mask's choice reads no tensor


def test_a_model_of_another_family_is_returned_unchanged_with_a_warning(comfy, caplog):
    import comfy.sd
    image = comfy.sd.load_diffusion_model(str(ensure_diffusion_model("sd35", "tiny", 0, default_directory())))
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        out = sparse(image)
    assert "is not a video model" in caplog.text and out.model_options == image.model_options


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_graph_recorded_in_one_phase_replays_the_other_phase_s_mask():
    """FlexAttention's block-sparse kernel against SDPA with the mask written out, in bf16, and a CUDA graph recorded
    over the op in the sparse phase replaying the dense phase after the switch (the phase tables change in place)."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    frames, per_frame = 8, 200  # 1600 tokens: block-sparse at 128
    q, k, v = (torch.randn(1, HEADS, frames * per_frame, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    sparsity = VideoSparsity(window=1, sink=1, dense_steps=0.5)
    mask = frame_window_mask(frames, per_frame, 1, 1).cuda()
    sparse = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    dense = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    def run():
        return video_sparsity.video_attention(q, k, v, per_frame, 1, 1)
    assert relative_error(run(), sparse) < 1e-2  # the first call compiles the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = run()
    graph.replay()
    assert relative_error(recorded, sparse) < 1e-2
    video_sparsity.set_dense(sparsity, True)
    graph.replay()
    assert relative_error(recorded, dense) < 1e-2
