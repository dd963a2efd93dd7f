"""Batch (CFG) and sequence parallelism over worker processes (parallel/), on the CPU with gloo as CI runs it: a call
split over 2 and 3 processes equals the call in one, a ComfyUI model's call too, and a worker that fails or dies fails
the call with a clear error and leaves no process behind."""
import multiprocessing
import os
import pickle

import pytest
import torch

from overdrive.parallel.batch_split import chunk_ranges, join, split_call
from overdrive.parallel.workers import WorkerDied, WorkerPool


class SeededNet:
    """A factory every process builds the same weights from (what a worker gets: something it can unpickle)."""

    def __call__(self, device):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(device)

        def call(x, timestep, context=None, options=None):
            scale = 2.0 if options and options.get("double") else 1.0
            return net(x * timestep[:, None] + context.mean(1)) * scale
        return call


class DiesWhenCalled(SeededNet):
    def __call__(self, device):
        def call(*args, **kwargs):
            os._exit(3)  # a crash no exception handler sees
        return call


class FailsToLoad(SeededNet):
    def __call__(self, device):
        raise FileNotFoundError("no such model file: missing.safetensors")


def a_call(batch=4, chunks=2):
    generator = torch.Generator().manual_seed(1)
    x, timestep = torch.randn(batch, 8, generator=generator), torch.rand(batch, generator=generator)
    kwargs = {"context": torch.randn(batch, 5, 8, generator=generator),
              "options": {"double": True, "cond_or_uncond": [1, 0][:chunks] if chunks <= 2 else list(range(chunks))}}
    return x, timestep, kwargs


def test_parts_follow_the_chunks_and_join_back():
    assert chunk_ranges(2, 2) == [(0, 1), (1, 2)] and chunk_ranges(3, 2) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="at most one part per chunk"):
        chunk_ranges(2, 3)
    x, timestep, kwargs = a_call(batch=4, chunks=2)
    parts = split_call(x, timestep, kwargs, chunks=2, parts=2)
    assert [p[0].shape[0] for p in parts] == [2, 2]
    assert [p[2]["options"]["cond_or_uncond"] for p in parts] == [[1], [0]]
    assert all(p[2]["options"]["double"] for p in parts)
    assert torch.equal(join([p[0] for p in parts]), x)
    with pytest.raises(ValueError, match="equal chunks"):
        split_call(torch.zeros(3, 8), timestep[:3], {}, chunks=2, parts=2)


@pytest.mark.parametrize("processes", [2, 3])
def test_a_call_split_over_processes_equals_the_call_in_one(processes):
    model = SeededNet()(torch.device("cpu"))
    x, timestep, kwargs = a_call(batch=6, chunks=3)
    expected = model(x, timestep, **kwargs)
    pool = WorkerPool(SeededNet(), processes, cuda=False).start()
    try:
        for _ in range(2):  # the workers keep their model between calls
            out = join(pool.run(split_call(x, timestep, kwargs, chunks=3, parts=processes), model))
            assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    finally:
        pool.close()
    assert not pool.alive() and not multiprocessing.active_children()


class UlyssesNet:
    """Self-attention over tokens split between the processes (parallel/sequence_split.py): each shards the call's
    image tokens (after `text` tokens every process holds whole, a call's keyword), attends with every rank's, and
    gathers; one process alone attends over them all."""

    def __call__(self, device):
        import torch.distributed as dist

        from overdrive.parallel.sequence_split import gather, shard, sharded_attention

        sdpa = torch.nn.functional.scaled_dot_product_attention  # (batch, heads, tokens, d)

        def call(x, timestep, text=0):
            q, k, v = x, x * timestep, x.flip(-1)
            if not dist.is_initialized():
                return sdpa(q, k, v)
            rank, world = dist.get_rank(), dist.get_world_size()
            q, k, v = (shard(t, 2, rank, world, text) for t in (q, k, v))
            return gather(sharded_attention(q, k, v, sdpa, text), 2, text)
        return call


@pytest.mark.parametrize("processes", [2, 3])
def test_attention_over_tokens_split_between_processes_equals_attention_in_one(processes):
    """Attention over 12 image tokens split between processes, alone (Wan's self-attention) and after 5 text tokens
    every process holds (Flux's, SD3's and Qwen-Image's joint attention): Ulysses where the heads divide (6), every
    process's keys gathered where they do not (4 over 3)."""
    net, timestep = UlyssesNet(), torch.tensor([0.5, 2.0])[:, None, None, None]
    cases = [(text, torch.randn(2, heads, text + 12, 4, generator=torch.Generator().manual_seed(2)))
             for text, heads in [(0, 6), (5, 6)] + ([(0, 4), (5, 4)] if processes == 3 else [])]
    expected = [net(torch.device("cpu"))(x, timestep) for _, x in cases]  # one process alone, before the group
    pool = WorkerPool(net, processes, cuda=False).start()
    try:
        for (text, x), want in zip(cases, expected):
            out = pool.run_everywhere((x, timestep, {"text": text}),
                                      lambda: net(torch.device("cpu"))(x, timestep, text=text))
            assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), (text, x.shape)
    finally:
        pool.close()
    assert not multiprocessing.active_children()


def test_a_worker_that_fails_to_load_names_why_and_leaves_no_process():
    with pytest.raises(WorkerDied, match="missing.safetensors"):
        WorkerPool(FailsToLoad(), 2, cuda=False).start()
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_mid_call_fails_the_call_and_leaves_no_process():
    pool = WorkerPool(DiesWhenCalled(), 2, cuda=False).start()
    x, timestep, kwargs = a_call()
    with pytest.raises(WorkerDied, match="worker 1 ended \\(exit code 3\\)"):
        pool.run(split_call(x, timestep, kwargs, chunks=2, parts=2), SeededNet()(torch.device("cpu")))
    assert not pool.alive() and not multiprocessing.active_children()
    pool.close()  # twice is harmless


class FailsInsideTheCollective:
    """Every process runs the call's all-to-all; the worker raises or dies before its part, leaving this process
    inside the collective."""

    def __init__(self, how):
        self.how = how

    def __call__(self, device):
        import torch.distributed as dist

        def call(x, timestep):
            if dist.get_rank() == 1:
                if self.how == "dies":
                    os._exit(3)
                raise MemoryError("out of memory in worker's block")
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x)
            return out
        return call


@pytest.mark.parametrize("how,says", [
    ("raises", "(?s)worker 1 failed while running its part.*out of memory in worker's block"),
    ("dies", "worker 1 ended \\(exit code 3\\)")])
def test_a_worker_that_fails_inside_a_sequence_parallel_call_fails_it_at_once_saying_why(how, says):
    import time
    net = FailsInsideTheCollective(how)
    pool = WorkerPool(net, 2, cuda=False).start()
    x = torch.randn(4, 3)
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=says):
        pool.run_everywhere((x, x, {}), lambda: net(torch.device("cpu"))(x, x))
    assert time.monotonic() - started < 30  # not the group's timeout
    assert not pool.alive() and not multiprocessing.active_children()


# Each family's splits, with the cfg it samples at: every family's passes split (CFG); the tokens of those sequence
# parallelism splits (its cross-attention text for Wan, its joint attention for the others), and auto choosing them
# where a call has one pass (CFG 1).
SPLITS = {"wan22": (("cfg", 5.0), ("sequence", 5.0), ("auto", 1.0)), "flux": (("cfg", 3.0), ("auto", 1.0)),
          "qwen_image": (("cfg", 2.5), ("sequence", 2.5)), "sd35": (("cfg", 4.5), ("sequence", 4.5)),
          "chroma": (("cfg", 4.0),), "zimage": (("cfg", 2.0),), "ltxv": (("cfg", 3.0),), "ltx2": (("cfg", 3.0),),
          "sd15": (("cfg", 7.0),)}


def family_case(family, builtin_dit_files, builtin_checkpoints):
    """(model as ComfyUI's loader loads its tiny file, positive, negative, latent): 16 image tokens (Wan: 8)."""
    import comfy.sd

    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.harness.inprocess import conditioning as unet_conditioning
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    if family == "sd15":
        model = comfy.sd.load_checkpoint_guess_config(
            str(builtin_checkpoints["overdrive-builtin-sd15.safetensors"]), output_vae=False, output_clip=False)[0]
        return (model, *unet_conditioning("sd15", 64, 64, seed=1), torch.zeros(1, 4, 8, 8))
    model = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES[family][0]]))
    return model, conditioning(family, 1), conditioning(family, 2), empty_latent(family, 64, 64, frames=5)


@pytest.fixture(scope="module")
def kept_workers():
    """Worker processes kept from one test to the next (each loads the next test's model into them), stopped after
    the last."""
    from overdrive.comfy_host.parallel_calls import POOLS
    yield POOLS
    POOLS.close()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("family", list(SPLITS))
def test_parallel_model_samples_what_one_process_samples(comfy, builtin_dit_files, builtin_checkpoints, caplog,
                                                         kept_workers, family):
    """Each family's tiny file as ComfyUI's loader loads it, sampled over two processes (the second loads the file
    into the worker the previous family's test left) by each of its splits in turn, every model call equal to the
    model's in this process alone."""
    import comfy.sample

    from overdrive.comfy_host.parallel_calls import parallelize
    from test_dit_families import assert_calls_match, record_calls, relative_error

    model, positive, negative, latent = family_case(family, builtin_dit_files, builtin_checkpoints)

    def sample(patcher, cfg):
        recorded, calls = record_calls(patcher)
        noise = comfy.sample.prepare_noise(latent, 0)
        out = comfy.sample.sample(recorded, noise, 1, cfg, "euler", "simple", positive, negative, latent, seed=0,
                                  disable_pbar=True)
        return out, calls

    for mode, cfg in SPLITS[family]:
        expected, expected_calls = sample(model, cfg)
        with caplog.at_level("INFO", logger="overdrive"):
            out, calls = sample(parallelize(model, 2, cuda=False, mode=mode), cfg)
        assert kept_workers.pool is not None and kept_workers.pool.alive()
        assert_calls_match(calls, expected_calls, 1e-5)
        for part, expected_part in zip(getattr(out, "tensors", [out]), getattr(expected, "tensors", [expected])):
            assert relative_error(part, expected_part) < 1e-5  # LTX-2: video and audio
        assert f"{'cfg' if mode == 'cfg' else 'sequence'} parallelism over 2 processes" in caplog.text
        caplog.clear()


def test_compile_models_forward_and_a_lora_applied_after_parallel_model_reach_the_workers(comfy, builtin_dit_files,
                                                                                         caplog):
    """Each worker's copy runs Compile Model's forward and attention as this process's does, with the weight patches
    a LoRA loader put on Parallel Model's output (the ModelPatcher that runs the calls): the split calls, by passes
    (CFG 5) and by tokens (CFG 1, the all-to-alls inside the compiled blocks), equal the compiled, patched model's in
    one process. What cannot reach the workers (a patch's function, another node's attention, the step cache) keeps
    the calls in this process."""
    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.comfy_host.worker_reload import ComfyReload
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.nodes import NODES
    from overdrive.comfy_host.comfy_call_options import ATTENTION_OVERRIDE
    from overdrive.comfy_host.forward_patch import installed_stack
    from overdrive.comfy_host.parallel_calls import POOLS, carried, parallelize, why_not_carried

    model = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]]))
    compiled = NODES["OverdriveCompileModel"].execute(model)[0]
    stack = installed_stack(compiled)
    assert stack is not None and stack.compile is not None
    assert installed_stack(ComfyReload(model.cached_patcher_init, {}, stack).load(torch.device("cpu"))) == stack
    override = compiled.model_options["transformer_options"][ATTENTION_OVERRIDE]
    assert carried(compiled.model_options["transformer_options"])[ATTENTION_OVERRIDE] is override
    assert pickle.loads(pickle.dumps(override)) is override  # one instance per settings in every process

    latent = empty_latent("wan22", 64, 64, frames=5)
    key, weight = next((f"diffusion_model.{k}", v) for k, v in model.model.diffusion_model.named_parameters()
                       if ".ffn." in k and k.endswith(".weight") and v.ndim == 2)
    diff = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.5 * weight.std()

    def sample(patcher, cfg):
        return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 2, cfg, "euler", "simple",
                                   conditioning("wan22", 1), conditioning("wan22", 2), latent, seed=0,
                                   disable_pbar=True)
    with_lora, parallel_lora = compiled.clone(), parallelize(compiled, 2, cuda=False).clone()
    for patcher in (with_lora, parallel_lora):
        patcher.add_patches({key: (diff,)}, 0.8)
    try:
        with caplog.at_level("INFO", logger="overdrive"):
            outs = [sample(parallel_lora, cfg) for cfg in (5.0, 1.0)]
        assert POOLS.pool is not None and POOLS.pool.alive()
    finally:
        POOLS.close()
    assert "cfg parallelism" in caplog.text and "sequence parallelism" in caplog.text
    assert "uncompiled" not in caplog.text
    for out, cfg in zip(outs, (5.0, 1.0)):
        expected = sample(with_lora, cfg)
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected, sample(compiled, 1.0), rtol=1e-3, atol=1e-4)  # the patch changed the result
    assert why_not_carried(parallel_lora) is None
    other = parallel_lora.clone()
    other.model_options["transformer_options"][ATTENTION_OVERRIDE] = lambda func, *args, **kwargs: func(*args,
                                                                                                       **kwargs)
    assert "another node's attention override" in why_not_carried(other)
    parallel_lora.add_patches({(key, None, lambda w: w * 2): (diff,)}, 1.0)
    assert "function of this process" in why_not_carried(parallel_lora)
    assert not multiprocessing.active_children()


def test_quantize_model_and_the_step_cache_reach_the_workers(comfy, builtin_dit_files, caplog):
    """Each worker quantizes its copy as Quantize Model quantized this one (the same layers and formats, from the
    decisions it cached: no calibration there) and runs the adaptive step cache, its measure of change summed over
    every process's part so that all reuse the steps one process would: split calls, by passes and by tokens, equal
    the quantized, cached model's in one process. A CFG split that leaves GPUs idle keeps adaptive calls here."""
    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.nodes import NODES
    from overdrive.comfy_host.parallel_calls import POOLS, parallelize, why_not_carried, why_not_with_idle_gpus
    from test_dit_families import quantize_every_layer

    model = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]]))
    report, quantized = quantize_every_layer(NODES, model, "wan22")
    assert report is not None and report.quantized
    cached = NODES["OverdriveDeepCache"].execute(quantized, mode="adaptive", threshold=0.5)[0]
    latent = empty_latent("wan22", 64, 64, frames=5)

    def sample(patcher, cfg):
        return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 6, cfg, "euler", "simple",
                                   conditioning("wan22", 1), conditioning("wan22", 2), latent, seed=0,
                                   disable_pbar=True)
    parallel = parallelize(cached, 2, cuda=False)
    assert why_not_carried(parallel) is None
    try:
        with caplog.at_level("INFO", logger="overdrive"):
            outs = [sample(parallel, cfg) for cfg in (5.0, 1.0)]
        assert POOLS.pool is not None and POOLS.pool.alive()
    finally:
        POOLS.close()
    assert "quantized as here" in caplog.text
    assert "cfg parallelism" in caplog.text and "sequence parallelism" in caplog.text
    for out, cfg in zip(outs, (5.0, 1.0)):
        assert torch.allclose(out, sample(cached, cfg), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(outs[1], sample(quantized, 1.0), rtol=1e-3, atol=1e-4)  # steps were reused
    assert not torch.allclose(sample(quantized, 1.0), sample(model, 1.0), rtol=1e-3, atol=1e-4)  # and quantized
    assert "2 passes leave some of the 3 GPUs idle" in why_not_with_idle_gpus(parallel, "cfg", 2, 3)
    assert why_not_with_idle_gpus(parallel, "sequence", 1, 3) is None
    default = NODES["OverdriveDeepCache"].execute(model)[0]  # auto: calibrated, which measures at a schedule's first run
    assert "2 passes leave some of the 3 GPUs idle" in why_not_with_idle_gpus(default, "cfg", 2, 3)
    assert not multiprocessing.active_children()


def test_switch_diffusion_models_weights_reach_the_workers(comfy, builtin_dit_files, caplog):
    """After Switch Diffusion Model the workers load the switched file (the model's reload recipe follows the switch)
    into the processes the first model ran in: split calls equal the switched model's in one process, not the first
    file's."""
    import comfy.sample
    import comfy.sd
    import folder_paths

    from overdrive.builtin_models.dit import conditioning, default_directory, empty_latent, ensure_diffusion_model
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.nodes import NODES
    from overdrive.comfy_host.parallel_calls import POOLS, parallelize
    from overdrive.comfy_host.switched_weights import reloading

    second = ensure_diffusion_model("wan22", "tiny", 1, default_directory())
    folder_paths.add_model_folder_path("diffusion_models", str(default_directory()))
    model = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]]))
    switched = NODES["OverdriveSwitchDiffusionModel"].execute(model, unet_name=second.name)[0]
    assert switched.cached_patcher_init[1][0] == str(second)
    assert reloading(model.cached_patcher_init, "checkpoints", "other.safetensors") is None  # another loader's file
    latent = empty_latent("wan22", 64, 64, frames=5)

    def sample(patcher):
        return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 2, 5.0, "euler", "simple",
                                   conditioning("wan22", 1), conditioning("wan22", 2), latent, seed=0,
                                   disable_pbar=True)
    try:
        first = sample(parallelize(model, 2, cuda=False, mode="cfg"))
        workers = [process.pid for process in POOLS.pool.processes]
        with caplog.at_level("INFO", logger="overdrive"):
            out = sample(parallelize(switched, 2, cuda=False, mode="cfg"))
        assert [process.pid for process in POOLS.pool.processes] == workers  # loaded into the same processes
        assert "loading another model into its 1 worker process(es)" in caplog.text
    finally:
        POOLS.close()
    assert torch.allclose(first, sample(model), rtol=1e-4, atol=1e-5)
    assert torch.allclose(out, sample(switched), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, first, rtol=1e-3, atol=1e-4)
    assert not multiprocessing.active_children()


def test_sequence_parallelism_refuses_what_it_does_not_split_and_says_why(comfy, builtin_dit_files):
    import comfy.sd

    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.comfy_host.parallel_calls import chosen_split
    from overdrive.comfy_host.sequence_split import how_attention_splits

    wan = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]]))
    chroma = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["chroma"][0]]))
    text = torch.zeros(1, 512, 4096)
    one_pass = {"cond_or_uncond": [0]}

    def why(model, x, processes, options=one_pass, mode="sequence", **kwargs):
        return chosen_split(mode, model.model.diffusion_model, x, None, options, processes, text, kwargs)
    video = torch.zeros(1, 48, 2, 4, 4)  # 8 tokens
    assert why(wan, video, 2) == ("sequence", None)
    assert "do not divide over 3" in why(wan, video, 3)[1]
    assert why(wan, torch.zeros(1, 48, 1, 8, 8), 4) == ("sequence", None)  # 2 heads: every process's keys gathered
    assert how_attention_splits(wan.model.diffusion_model, 4) == "gathered keys attention, 2 heads"
    assert how_attention_splits(wan.model.diffusion_model, 2) == "ulysses attention, 2 heads"
    assert "as long as its text" in why(wan, torch.zeros(1, 48, 1, 64, 64), 2)[1]  # 1,024 tokens, 512 a process
    assert "reference latents" in why(wan, video, 2, reference_latent=torch.zeros(1))[1]
    assert "replace or patch its blocks" in why(wan, video, 2, {**one_pass, "patches_replace": {"dit": {0: 0}}})[1]
    assert "attention mask" in why(wan, video, 2, attention_mask=torch.ones(1, 512))[1]
    assert "Chroma is not among the families" in why(chroma, torch.zeros(1, 16, 8, 8), 2)[1]
    every = why(wan, video, 3, mode="auto")[1]  # no split applies: every reason, once
    assert "one pass" in every and "do not divide over 3" in every and every.count("one pass") == 1
    two_passes = {"cond_or_uncond": [0, 1]}
    video_pair = torch.zeros(2, 48, 2, 4, 4)
    assert why(wan, video_pair, 4, two_passes, mode="auto") == ("both", None)  # each pass on 2 processes
    assert why(wan, video_pair, 2, two_passes, mode="auto") == ("cfg", None)
    assert "do not form a group of 2 or more" in why(wan, video_pair, 3, two_passes, mode="both")[1]


def test_the_node_runs_on_one_gpu_with_a_warning_where_the_gpus_are_missing_and_names_bad_input(comfy, caplog):
    import comfy.model_patcher

    from overdrive.comfy_host.parallel_calls import KEY, parallelize
    from overdrive.nodes.parallel_model import OverdriveParallelModel
    model = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    with caplog.at_level("WARNING", logger="overdrive"):
        out = OverdriveParallelModel.execute(model, gpus=max(2, torch.cuda.device_count() + 1))[0]
    assert out is not model and KEY not in str(out.wrappers) and "runs on one GPU" in caplog.text
    with pytest.raises(ValueError, match="unknown mode 'ring'"):
        OverdriveParallelModel.execute(model, gpus=2, mode="ring")
    with pytest.raises(ValueError, match="loaded from a file"):
        parallelize(model, 2, cuda=False)  # built in memory: nothing for the workers to load


def test_an_interrupted_prompt_leaves_the_workers_ready_for_the_next(comfy, builtin_dit_files):
    """ComfyUI's interrupt ends sampling between steps: the prompt stops, the workers stay up, and the next prompt
    samples what it samples uninterrupted."""
    import comfy.model_management
    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.comfy_host.parallel_calls import POOLS, parallelize

    model = comfy.sd.load_diffusion_model(str(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]]))
    latent = empty_latent("wan22", 64, 64, frames=5)

    def sample(patcher, callback=None):
        return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 3, 5.0, "euler", "simple",
                                   conditioning("wan22", 1), conditioning("wan22", 2), latent, seed=0,
                                   disable_pbar=True, callback=callback)

    def interrupt_at_second_step(step, *args):
        if step == 1:
            comfy.model_management.interrupt_current_processing()
            comfy.model_management.throw_exception_if_processing_interrupted()
    parallel = parallelize(model, 2, cuda=False)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            sample(parallel, interrupt_at_second_step)
        pool = POOLS.pool
        assert pool is not None and pool.alive()
        assert torch.allclose(sample(parallel), sample(model), rtol=1e-4, atol=1e-5)
        assert POOLS.pool is pool  # the same workers: nothing reloaded
    finally:
        comfy.model_management.interrupt_current_processing(False)
        POOLS.close()
    assert not multiprocessing.active_children()


def test_workers_that_cannot_start_leave_the_generation_on_one_process_with_a_warning(comfy, builtin_dit_files,
                                                                                      tmp_path, caplog):
    """The file the workers would reload is gone: the prompt samples what the model alone samples, warned once."""
    import shutil

    import comfy.sample
    import comfy.sd

    from overdrive.builtin_models.dit import conditioning, empty_latent
    from overdrive.harness.workflows import BUILTIN_DIT_NAMES
    from overdrive.comfy_host.parallel_calls import POOLS, parallelize

    path = tmp_path / "moved.safetensors"
    shutil.copy(builtin_dit_files["diffusion_models"][BUILTIN_DIT_NAMES["wan22"][0]], path)
    model = comfy.sd.load_diffusion_model(str(path))
    path.unlink()
    latent = empty_latent("wan22", 64, 64, frames=5)

    def sample(patcher):
        return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 2, 5.0, "euler", "simple",
                                   conditioning("wan22", 1), conditioning("wan22", 2), latent, seed=0,
                                   disable_pbar=True)
    with caplog.at_level("WARNING", logger="overdrive"):
        out = sample(parallelize(model, 2, cuda=False))
    assert torch.equal(out, sample(model))
    assert caplog.text.count("did not start") == 1, caplog.text
    assert POOLS.pool is None and not multiprocessing.active_children()


def test_cfg_and_sequence_at_once_split_each_pass_over_its_own_two_of_four_processes(comfy, builtin_dit_files, caplog):
    """Four processes, CFG's two passes: each pass on a group of two that splits its tokens ("both", what auto picks
    here), each call equal to the model alone's (Wan; the joint attention of SD3's is split the same way by
    tests/test_diffusers_parallel.py)."""
    import comfy.sample

    from overdrive.comfy_host.parallel_calls import POOLS, parallelize
    from test_dit_families import assert_calls_match, record_calls

    try:
        for family, cfg in (("wan22", 5.0),):
            model, positive, negative, latent = family_case(family, builtin_dit_files, None)

            def sample(patcher):
                recorded, calls = record_calls(patcher)
                out = comfy.sample.sample(recorded, comfy.sample.prepare_noise(latent, 0), 1, cfg, "euler", "simple",
                                          positive, negative, latent, seed=0, disable_pbar=True)
                return out, calls
            expected, expected_calls = sample(model)
            with caplog.at_level("INFO", logger="overdrive"):
                out, calls = sample(parallelize(model, 4, cuda=False, mode="auto"))
            assert_calls_match(calls, expected_calls, 1e-5)
            assert "both parallelism over 4 processes (ulysses attention" in caplog.text, family
            caplog.clear()
    finally:
        POOLS.close()
    assert not multiprocessing.active_children()
