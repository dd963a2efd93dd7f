"""CUDA-graph replay of DiT blocks (compiler/block_graphs.py) on a real GPU: ComfyUI's own loader and sampler over the
built-in tiny Flux.1 (blocks that write their inputs in place) and Qwen-Image (blocks that return new tensors) files,
compiled by Compile Model. Every model call of the replayed model matches the same compiled model without graphs; a
LoRA patch after the recording, the step cache's reused steps and switched weights are followed; a block that cannot
be recorded runs as before.

Skipped without CUDA (CI has none). Run it alone: `python3 -m pytest tests/test_block_graphs_gpu.py`.
"""
import logging

import pytest
import torch

from overdrive.compiler.block_graphs import BlockGraphs
from overdrive.families import BlockStack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RES, STEPS, CFG = 256, 5, 3.0
TOLERANCE = 2e-3  # the same kernels with and without graphs, bf16 (measured in the log)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False)


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODES
    return NODES


@pytest.fixture(scope="module", params=["flux", "qwen_image"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def files(comfy, family):
    import folder_paths
    from overdrive.builtin_models.dit import default_directory, ensure_diffusion_model

    folder = default_directory()
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    return [ensure_diffusion_model(family, "tiny", seed, folder) for seed in (0, 1)]


@pytest.fixture(scope="module")
def base(comfy, files):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(files[0]))


@pytest.fixture(scope="module")
def sample(comfy, family):
    import comfy.sample
    from overdrive.builtin_models.dit import conditioning, empty_latent

    positive, negative = conditioning(family, 1), conditioning(family, 2)

    def run(model):
        calls = []

        def wrapper(apply_model, args):
            out = apply_model(args["input"], args["timestep"], **args["c"])
            calls.append(out.detach().float().clone())
            return out
        recorded = model.clone()
        recorded.set_model_unet_function_wrapper(wrapper)
        latent = empty_latent(family, RES, RES, 5)
        noise = comfy.sample.prepare_noise(latent, 7)
        out = comfy.sample.sample(recorded, noise, STEPS, CFG, "euler", "simple", positive, negative, latent, seed=7,
                                  disable_pbar=True)
        return out, calls
    return run


def forward_of(model):
    return model.object_patches["diffusion_model.forward"]


def assert_calls_match(calls, reference):
    assert len(calls) == len(reference) > 0
    errors = [relative_error(a, b) for a, b in zip(calls, reference)]
    logging.getLogger("overdrive").info("per-call relative error, graphs vs none: max %.2e", max(errors))
    assert max(errors) < TOLERANCE, errors


@pytest.fixture(scope="module")
def compiled(nodes, base):
    return (nodes["OverdriveCompileModel"].execute(base)[0],
            nodes["OverdriveCompileModel"].execute(base, cuda_graphs=False)[0])


def test_replayed_blocks_match_the_compiled_blocks_per_call(compiled, sample, family):
    with_graphs, without = compiled
    _, reference = sample(without)
    out, calls = sample(with_graphs)
    graphs = forward_of(with_graphs).graphs
    assert graphs.recorded == len(forward_of(with_graphs).blocks)  # every block, at its second call
    assert graphs.replays > 0
    assert_calls_match(calls, reference)
    replays = graphs.replays
    _, again = sample(with_graphs)  # a second run: replays only, records nothing
    assert graphs.recorded == len(forward_of(with_graphs).blocks) and graphs.replays > replays
    assert_calls_match(again, reference)


def test_a_lora_patch_after_the_recording_is_followed(compiled, base, sample):
    with_graphs, without = compiled
    sample(with_graphs)
    key, weight = next((f"diffusion_model.{k}", v) for k, v in base.model.diffusion_model.named_parameters()
                       if k.endswith(".weight") and v.ndim == 2 and "blocks" in k)
    diff = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.5 * weight.float().std().cpu()
    patched, reference = with_graphs.clone(), without.clone()
    for m in (patched, reference):
        m.add_patches({key: (diff.to(weight.dtype),)}, 1.0)
    (out, calls), (_, expected) = sample(patched), sample(reference)
    assert_calls_match(calls, expected)
    assert relative_error(out, sample(with_graphs)[0]) > 1e-3  # the patch changed the result


def test_sequence_parallel_blocks_replay_their_collectives_and_drop_them_before_leaving_the_group(compiled, sample):
    """Parallel Model's sequence split inside compiled blocks (a group of one NCCL process: each collective a copy):
    the blocks record their all-to-alls into CUDA graphs and match the blocks without graphs per call; leaving the
    group drops those recordings first and returns (with them held, NCCL's destroy_process_group hangs)."""
    import socket
    import threading

    import torch.distributed as dist

    from overdrive.comfy_host.sequence_split import as_each_process_runs
    from overdrive.parallel.workers import leave_group

    with_graphs, without = compiled
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _, reference = sample(as_each_process_runs(without))
        graphs = forward_of(with_graphs).graphs
        graphs.release()
        recorded, replays = graphs.recorded, graphs.replays
        _, calls = sample(as_each_process_runs(with_graphs))
        assert graphs.recorded > recorded and graphs.replays > replays
        assert_calls_match(calls, reference)
    finally:
        leaving = threading.Thread(target=leave_group, daemon=True)
        leaving.start()
        leaving.join(timeout=60)
    assert not leaving.is_alive() and not dist.is_initialized()
    assert not graphs._recordings  # dropped: the next call records again


def test_switched_weights_are_read_by_the_replay(nodes, compiled, files, sample):
    with_graphs, without = compiled
    sample(with_graphs)
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(with_graphs, unet_name=files[1].name)[0]
    reference = nodes["OverdriveSwitchDiffusionModel"].execute(without, unet_name=files[1].name)[0]
    out, calls = sample(switched)
    assert_calls_match(calls, sample(reference)[1])
    assert relative_error(out, sample(with_graphs)[0]) > 1e-3


def test_the_step_cache_over_replayed_blocks_matches_it_without_graphs(nodes, compiled, sample):
    with_graphs, without = (nodes["OverdriveDeepCache"].execute(m, mode="fixed", cache_interval=2)[0] for m in compiled)
    _, reference = sample(without)
    _, calls = sample(with_graphs)
    assert_calls_match(calls, reference)


# -- BlockGraphs alone, over toy blocks ----------------------------------------------------------------------------
class NewOutputBlock(torch.nn.Module):
    """Returns new tensors (Qwen-Image's and Wan's blocks do), and reads a shared side input."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(64, 64, generator=g) / 8, requires_grad=False)

    def forward(self, x, side, scale=1.0):
        return torch.tanh(x @ self.weight + side) * scale


class SyncingBlock(NewOutputBlock):
    def forward(self, x, side, scale=1.0):
        if x.sum().item() > 1e30:  # a host read: cannot be recorded
            return x
        return super().forward(x, side, scale)


TOY = BlockStack("blocks", streams=(("x", 0),), returns=("x",))


def run_chain(blocks, graphs, x, side, scale=1.0):
    if graphs is not None:
        graphs.forget_copies()
    for i, block in enumerate(blocks):
        if graphs is None:
            x = block(x, side, scale)
        else:
            x = graphs.call(f"blocks.{i}", block, TOY, block.forward, (x, side), {"scale": scale})
    return x.clone()


def assert_chain_matches_plain_calls(blocks, graphs, calls: int) -> None:
    """`calls` runs of the chain through `graphs`, each equal to the blocks called plainly."""
    x, side = torch.randn(8, 64, device="cuda"), torch.zeros(64, device="cuda")
    for _ in range(calls):
        assert torch.allclose(run_chain(blocks, graphs, x, side), run_chain(blocks, None, x, side), atol=1e-6)


def test_fused_fp8_mlps_replay_and_stay_within_rounding_of_their_layers_run_apart(nodes, base, family, sample):
    """Quantize Model in fp8 (every layer) on the GPU: Flux's and Qwen-Image's MLPs run fc1 + tanh-GELU + fc2's cast
    as cuBLASLt's fused kernel, eager and in the replayed blocks; per model call the replay matches the fused model
    eager, and the fused model stays within bf16 rounding of the same layers run apart (fc1's output is no longer
    rounded to bf16 before GELU)."""
    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.comfy_host.quantized_state import quantized_modules
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    quantized = nodes["OverdriveQuantizeModel"].execute(
        base, format="fp8_e4m3", compute_density_threshold=0.0, min_speedup=0.0, calibration_steps=1,
        positive=conditioning(family, 1), negative=conditioning(family, 2),
        latent={"samples": empty_latent(family, RES, RES, 5)})[0]
    linked = [layer for layer in quantized_modules(quantized).values() if getattr(layer, "gelu_dtype", None)]
    assert linked
    _, fused = sample(quantized)
    _, replayed = sample(nodes["OverdriveCompileModel"].execute(quantized)[0])
    dtypes = [layer.gelu_dtype for layer in linked]
    for layer in linked:
        layer.gelu_dtype = None
    try:
        _, apart = sample(quantized)
    finally:
        for layer, dtype in zip(linked, dtypes):
            layer.gelu_dtype = dtype
    first = [relative_error(a, b) for a, b in ((replayed[0], fused[0]), (fused[0], apart[0]))]
    logging.getLogger("overdrive").info("%s: %d fused MLPs; first call: replay vs eager %.2e, fused vs apart %.2e",
                                        family, len(linked), *first)
    assert first[0] < 2e-2 and first[1] < 2e-2, first


@torch.inference_mode()
def test_toy_chain_of_new_output_blocks_matches_plain_calls_for_changing_inputs():
    blocks = [NewOutputBlock(seed).cuda() for seed in range(3)]
    graphs = BlockGraphs()
    for call in range(5):
        x = torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(call))
        side = torch.full((64,), 0.1 * call, device="cuda")
        assert torch.allclose(run_chain(blocks, graphs, x, side), run_chain(blocks, None, x, side), atol=1e-6)
    assert graphs.recorded == 3 and graphs.replays == 3 * 4
    # Another non-tensor argument is another signature: plain at first, recorded at its second call.
    for _ in range(2):
        assert torch.allclose(run_chain(blocks, graphs, x, side, 2.0), run_chain(blocks, None, x, side, 2.0),
                              atol=1e-6)
    assert graphs.recorded == 6
    # Weights replaced (as a LoRA patch does): recorded again, and followed.
    blocks[1].weight = torch.nn.Parameter(blocks[1].weight * 2, requires_grad=False)
    for _ in range(3):
        assert torch.allclose(run_chain(blocks, graphs, x, side, 2.0), run_chain(blocks, None, x, side, 2.0),
                              atol=1e-6)
    assert graphs.recorded == 7
    # Released (ComfyUI unloads the model): the next calls record again, into one shared pool again.
    graphs.release()
    for _ in range(2):
        assert torch.allclose(run_chain(blocks, graphs, x, side, 2.0), run_chain(blocks, None, x, side, 2.0),
                              atol=1e-6)
    assert graphs.recorded == 10 and graphs._pool is not None


@torch.inference_mode()
def test_a_block_that_cannot_be_recorded_runs_as_before_with_a_warning(caplog):
    blocks = [NewOutputBlock(0).cuda(), SyncingBlock(1).cuda()]
    graphs = BlockGraphs()
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        assert_chain_matches_plain_calls(blocks, graphs, calls=4)
    assert graphs.recorded == 1
    assert "block blocks.1 (and any other for the same reason) runs without a CUDA graph" in caplog.text


@torch.inference_mode()
def test_a_model_whose_blocks_fail_to_record_twice_records_no_more(caplog):
    blocks = [SyncingBlock(0).cuda(), SyncingBlock(1).cuda(), NewOutputBlock(2).cuda()]
    graphs = BlockGraphs()
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        assert_chain_matches_plain_calls(blocks, graphs, calls=4)
    assert graphs.recorded == 0 and graphs._stopped is not None
    assert torch.randn(4, device="cuda").isfinite().all()  # the failed captures left the generator usable


@torch.inference_mode()
def test_a_transposed_first_input_is_chained_through_contiguous_buffers():
    """Wan's first block gets its input transposed: the blocks after it must still see the contiguous layout their
    own graph was compiled for (a strided buffer made them all run the first block's graph, slower)."""
    blocks = [NewOutputBlock(seed).cuda() for seed in range(3)]
    graphs = BlockGraphs()
    side = torch.zeros(64, device="cuda")
    for call in range(3):
        x = torch.randn(64, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(call)).t()
        assert not x.is_contiguous()
        assert torch.allclose(run_chain(blocks, graphs, x, side), run_chain(blocks, None, x, side), atol=1e-6)
    statics = [s for recording in graphs._recordings.values() for s in recording.inputs]
    assert graphs.recorded == 3 and all(s.is_contiguous() for s in statics)


class Stop(Exception):
    """Stands in for ComfyUI's stop exception (recognised by its module and name, overdrive/interrupts.py)."""


Stop.__module__, Stop.__name__ = "comfy.model_management", "InterruptProcessingException"


class StoppableBlock(NewOutputBlock):
    stop = False

    def forward(self, x, side, scale=1.0):
        if self.stop:
            raise Stop("interrupted")
        return super().forward(x, side, scale)


@torch.inference_mode()
def test_a_stop_during_the_recording_ends_the_call_and_the_block_records_later():
    block = StoppableBlock(0).cuda()
    graphs = BlockGraphs()
    x, side = torch.randn(8, 64, device="cuda"), torch.zeros(64, device="cuda")
    run_chain([block], graphs, x, side)  # the first call runs as is
    block.stop = True
    with pytest.raises(Stop):
        run_chain([block], graphs, x, side)  # the recording's warm-up is stopped: the stop reaches the caller
    block.stop = False
    assert torch.allclose(run_chain([block], graphs, x, side), run_chain([block], None, x, side), atol=1e-6)
    assert graphs.recorded == 1  # not refused: the next call recorded it


class PoolHungryBlock(NewOutputBlock):
    """Runs out of memory while it is being recorded, the capture invalidated first (as a short card's recording
    failed: an operation the capture cannot hold, then the allocator's error)."""

    def forward(self, x, side, scale=1.0):
        if torch.cuda.is_current_stream_capturing():
            try:
                x.sum().item()  # a host read: invalidates the capture
            except Exception:  # noqa: BLE001
                pass
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 742.00 MiB.")
        return super().forward(x, side, scale)


@torch.inference_mode()
def test_a_recording_out_of_memory_stops_recording_for_the_model_and_leaves_the_allocator_usable(caplog):
    """Out of memory while recording: the blocks run unrecorded from then on (each would fail alike), outputs match,
    and later recordings and random draws on the GPU still work (a failed one left the allocator routing its stream
    into the pool, "already recording to mempool_id", the warm-ups' memory reserved there, and the default generator
    in capture mode: "Offset increment outside graph capture")."""
    blocks = [PoolHungryBlock(0).cuda(), NewOutputBlock(1).cuda()]
    graphs = BlockGraphs()
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        assert_chain_matches_plain_calls(blocks, graphs, calls=4)
    assert graphs.recorded == 0 and "out of memory" in caplog.text.lower()
    assert "already recording" not in caplog.text
    fresh = BlockGraphs()
    assert_chain_matches_plain_calls([NewOutputBlock(seed).cuda() for seed in range(2)], fresh, calls=3)
    assert fresh.recorded == 2 and fresh.replays == 4  # the second call records and replays each, the third replays


@torch.inference_mode()
def test_a_card_with_room_for_one_copy_of_the_working_memory_still_records_its_blocks(caplog):
    """A short card: a recording's warm-up leaves the block's working memory cached on the side stream, where the
    graph's pool cannot take it. The recorder gives that cache back before the capture (without it, 4-bit Wan 2.2 14B
    on a 16 GiB card ran out of memory inside its first capture, gigabytes cached and unused). The card here holds the
    hidden states, the recording's static buffer and the warm-up's copy of them, and one and a half working sets."""
    block = NewOutputBlock(0).cuda()
    x, side = torch.randn(2**21, 64, device="cuda"), torch.zeros(64, device="cuda")  # 512 MiB of hidden states
    reference = run_chain([block], None, x, side).cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    block(x, side)
    working, hidden = torch.cuda.max_memory_allocated() - base, x.numel() * x.element_size()
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_reserved() + 2 * hidden + 1.5 * working
    graphs = BlockGraphs()
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
            outputs = [run_chain([block], graphs, x, side).cpu() for _ in range(3)]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        graphs.release()
        torch.cuda.empty_cache()
    assert "runs without a CUDA graph" not in caplog.text
    assert graphs.recorded == 1 and graphs.replays == 2  # the second call records and replays, the third replays
    assert all(torch.allclose(out, reference, atol=1e-6) for out in outputs)
