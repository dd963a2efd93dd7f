"""The DiT step cache's arithmetic on a toy two-stack model, its steps read as ComfyUI's nodes read them
(comfy_host/comfy_steps.py, from ComfyUI-shaped transformer_options): what a reused step computes, run and branch
boundaries, the adaptive rule, and bad settings. The families' real models are covered in test_dit_families.py."""
import pytest
import torch

from overdrive.core.blockwise import BlockwiseForward
from overdrive.step_cache import DeepCacheConfig, DeepCacheConfigError, DeepCacheUnsupportedError
from overdrive.step_cache.block_cache import relative_change
from overdrive.families import Family, BlockStack


class Pair(torch.nn.Module):
    """A dual-stream block: forward(img, txt) -> (txt, img), as Qwen-Image orders its outputs."""

    def __init__(self, width):
        super().__init__()
        self.img, self.txt = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, img, txt, transformer_options=None):
        return txt + torch.tanh(self.txt(img.mean(1, keepdim=True))), img + torch.tanh(self.img(img) + txt.mean(1, True))


class Single(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mix = torch.nn.Linear(width, width)

    def forward(self, x, transformer_options=None):
        return x + torch.tanh(self.mix(x))


class Toy(torch.nn.Module):
    """Three dual-stream blocks, then two single-stream blocks over the concatenated tokens."""

    def __init__(self, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.pairs = torch.nn.ModuleList(Pair(width) for _ in range(3))
        self.singles = torch.nn.ModuleList(Single(width) for _ in range(2))

    def forward(self, img, txt, transformer_options=None):
        for block in self.pairs:
            txt, img = block(img=img, txt=txt, transformer_options=transformer_options)
        x = torch.cat((txt, img), 1)
        for block in self.singles:
            x = block(x, transformer_options=transformer_options)
        return x[:, txt.shape[1]:]


TOY = Family("toy", frozenset({"Toy"}), (
    BlockStack("pairs", streams=(("img", 0), ("txt", 1)), returns=("txt", "img"), probe="img"),
    BlockStack("singles", streams=(("x", 0),), returns=("x",)),
))


def call(forward, img, txt, sigma, branch=(0,)):
    options = {"sigmas": torch.tensor([sigma]), "cond_or_uncond": list(branch)}
    return forward(img, txt, transformer_options=options)


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 6, 8, generator=g), torch.randn(1, 3, 8, generator=g)


@pytest.fixture
def toy(comfy):  # the step reader is in nodes/, which imports ComfyUI
    return Toy()


def cached(toy, **config):
    """The toy under the step cache; "fixed" where no mode is given (the tests of the schedule's arithmetic)."""
    from overdrive.comfy_host.comfy_steps import ComfySteps
    return BlockwiseForward(toy, TOY, cache_config=DeepCacheConfig(**{"mode": "fixed", **config}),
                            read_step=ComfySteps())


def test_a_step_cache_without_a_step_reader_is_refused(toy):
    with pytest.raises(ValueError, match="a step cache needs read_step"):
        BlockwiseForward(toy, TOY, cache_config=DeepCacheConfig())


def test_interval_1_runs_every_block(toy):
    forward = cached(toy, cache_interval=1)
    for sigma, seed in ((1.0, 1), (0.5, 2), (0.25, 3)):
        img, txt = inputs(seed)
        assert torch.equal(call(forward, img, txt, sigma), toy(img, txt))


def test_a_reused_step_runs_the_first_blocks_and_adds_each_stack_s_recorded_residual(toy):
    forward = cached(toy, cache_interval=2, cache_depth=1)
    img0, txt0 = inputs(1)
    assert torch.equal(call(forward, img0, txt0, 1.0), toy(img0, txt0))  # full step: exact

    # The residuals the full step left, computed by hand: pairs[1:] and all singles.
    txt1, img1 = toy.pairs[0](img0, txt0)
    txt3, img3 = toy.pairs[2](*reversed(toy.pairs[1](img1, txt1)))
    x_in = torch.cat((txt3, img3), 1)
    x_out = toy.singles[1](toy.singles[0](x_in))

    img, txt = inputs(2)
    t1, i1 = toy.pairs[0](img, txt)  # the reused step runs the first block only
    t, i = t1 + (txt3 - txt1), i1 + (img3 - img1)
    x = torch.cat((t, i), 1)
    expected = (x + (x_out - x_in))[:, t.shape[1]:]
    out = call(forward, img, txt, 0.5)
    assert torch.allclose(out, expected, atol=1e-6)
    assert not torch.allclose(out, toy(img, txt), atol=1e-3)  # it really reused
    assert forward.step_cache.stats.shallow_steps == 1 and forward.step_cache.stats.full_steps == 1


def test_the_run_states_what_the_cache_keeps_between_steps(toy):
    """Per branch, each stack's residual (every stream it carries) and the adaptive probe's reference: their bytes
    are the run's `kept_bytes`, which its summary logs."""
    forward = cached(toy, mode="adaptive", threshold=0.0, cache_depth=1)  # every step full
    img, txt = inputs(1)
    pairs = img.numel() + txt.numel()
    singles = (img.shape[1] + txt.shape[1]) * img.shape[2]
    per_branch = (pairs + singles + img.numel()) * img.element_size()
    for step, sigma in enumerate((1.0, 0.5), 1):  # the second step's residuals replace the first's
        for branch in ((0,), (1,)):  # cond and uncond called apart: each keeps its own
            call(forward, img, txt, sigma, branch)
        stats = forward.step_cache.stats
        assert stats.full_steps == step and stats.kept_bytes == forward.step_cache.kept_bytes() == 2 * per_branch
    assert f"kept {2 * per_branch / 2**20:.2f} MiB between steps" in forward.step_cache.schedule.summary()


class InPlaceSingle(Single):
    """Adds to its input in place, as Flux's blocks do (`x += ...`)."""

    def forward(self, x, transformer_options=None):
        x += torch.tanh(self.mix(x))
        return x


def test_blocks_that_add_to_their_input_in_place_leave_the_same_residual(toy):
    """The residual is taken against a copy of the skipped blocks' input: an in-place block (Flux's) would otherwise
    leave a residual of zero, and a reused step would skip the blocks' contribution altogether."""
    in_place = Toy()
    in_place.singles = torch.nn.ModuleList(InPlaceSingle(8) for _ in range(2))
    in_place.singles.load_state_dict(toy.singles.state_dict())
    img, txt = inputs(1)
    assert torch.allclose(in_place(img.clone(), txt.clone()), toy(img, txt))
    steps = [(1.0, inputs(1)), (0.5, inputs(2))]
    out_of_place, forward = cached(toy, cache_interval=2), cached(in_place, cache_interval=2)
    expected = [call(out_of_place, *x, sigma) for sigma, x in steps]
    outs = [call(forward, *x, sigma) for sigma, x in steps]
    assert forward.step_cache.stats.shallow_steps == out_of_place.step_cache.stats.shallow_steps == 1
    residual = forward.step_cache._residuals[((0,), (1, 6, 8)), 1]["x"]
    assert residual.abs().max() > 0.1
    assert torch.allclose(outs[-1], expected[-1], atol=1e-6)


def test_a_new_run_never_reuses_the_last_run_s_residuals(toy):
    forward = cached(toy, cache_interval=2)
    img, txt = inputs(1)
    call(forward, img, txt, 1.0)
    call(forward, *inputs(2), 0.5)
    img, txt = inputs(3)
    assert torch.equal(call(forward, img, txt, 1.0), toy(img, txt))  # sigma went up: a new run, full
    assert forward.step_cache.last_stats.steps == 2


def test_each_branch_reuses_its_own_residuals_and_a_branch_without_any_runs_full(toy):
    forward = cached(toy, cache_interval=2)
    cond, uncond = inputs(1), inputs(2)
    call(forward, *cond, 1.0, branch=(0,))
    call(forward, *uncond, 1.0, branch=(1,))
    reused_cond = call(forward, *inputs(3), 0.5, branch=(0,))
    only_cond = cached(toy, cache_interval=2)
    call(only_cond, *cond, 1.0, branch=(0,))
    assert torch.equal(reused_cond, call(only_cond, *inputs(3), 0.5, branch=(0,)))
    img, txt = inputs(4)
    assert torch.equal(call(forward, img, txt, 0.5, branch=(0, 1)), toy(img, txt))  # nothing recorded for (0, 1)
    assert forward.step_cache.stats.fallback_calls == 1


def test_adaptive_reuses_only_while_the_first_blocks_changed_less_than_the_threshold(toy):
    img, txt = inputs(1)
    never = cached(toy, mode="adaptive", threshold=0.0)
    always = cached(toy, mode="adaptive", threshold=1e9)
    for sigma in (1.0, 0.8, 0.6):
        small_change = (img * (1 + 0.01 * (1 - sigma)), txt)
        assert torch.equal(call(never, *small_change, sigma), toy(*small_change))
        call(always, *small_change, sigma)
    assert never.step_cache.stats.full_steps == 3
    assert (always.step_cache.stats.full_steps, always.step_cache.stats.shallow_steps) == (1, 2)
    assert len(always.step_cache.changes) == 2 and all(0 < c < 0.01 for c in always.step_cache.changes)


def test_calibrated_measures_a_schedules_first_run_and_replays_its_decisions_on_later_runs(toy):
    """Later runs of the same schedule reuse the steps the first run's measure reused, whatever their own inputs
    would measure, and read nothing from the device; a new schedule is measured again."""
    forward = cached(toy, mode="calibrated", threshold=0.005)
    img, txt = inputs(1)
    sigmas = (1.0, 0.8, 0.6, 0.4)
    for sigma, scale in zip(sigmas, (1.0, 1.001, 1.002, 1.1)):  # the last step changes by far more than the threshold
        call(forward, img * scale, txt, sigma)
    first = forward.step_cache.stats.decisions
    assert first == [True, False, False, True] and len(forward.step_cache.changes) == 3
    other_img = inputs(2)[0]
    outputs = [call(forward, other_img * (1 + i), txt, sigma) for i, sigma in enumerate(sigmas)]  # large changes
    assert forward.step_cache.stats.decisions == first and forward.step_cache.changes == []
    assert torch.equal(outputs[0], toy(other_img, txt)) and torch.equal(outputs[3], toy(other_img * 4, txt))
    assert not torch.equal(outputs[1], toy(other_img * 2, txt))  # reused, as the first run decided
    for sigma in (0.9, 0.7):  # another schedule: measured
        call(forward, img, txt, sigma)
    assert len(forward.step_cache.changes) == 1
    forward.reset()  # a run ended: the decisions stay
    call(forward, img, txt, 1.0), call(forward, img, txt, 0.8)
    assert forward.step_cache.changes == []
    forward.reset(new_weights=True)  # measured on other weights: measured again
    call(forward, img, txt, 1.0), call(forward, img, txt, 0.8)
    assert len(forward.step_cache.changes) == 1


def test_calibrated_measures_every_run_inside_a_call_split_over_the_group(toy):
    """Processes of one split call may hold different decisions (a restarted worker): they all measure, so that each
    takes part in the measure's all-reduce."""
    import torch.distributed as dist

    from overdrive.harness.server import free_port
    from overdrive.parallel.agreement import whole_group_call
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        forward = cached(toy, mode="calibrated", threshold=1e9)
        img, txt = inputs(1)
        for _ in range(2):
            with whole_group_call():
                call(forward, img, txt, 1.0), call(forward, img, txt, 0.8)
            assert len(forward.step_cache.changes) == 1
    finally:
        dist.destroy_process_group()


def test_auto_is_calibrated_at_the_familys_threshold(toy):
    """The default settings on a DiT: decided by measure at the threshold its family record names."""
    import dataclasses
    from overdrive.comfy_host.comfy_steps import ComfySteps
    for family, threshold in ((TOY, 0.2), (dataclasses.replace(TOY, step_cache_threshold=0.15), 0.15)):
        forward = BlockwiseForward(toy, family, cache_config=DeepCacheConfig(), read_step=ComfySteps())
        assert (forward.step_cache.config.mode, forward.step_cache.config.threshold) == ("calibrated", threshold)
    assert DeepCacheConfig(mode="adaptive", threshold=0.3).for_family(0.15).threshold == 0.3  # chosen: kept


def test_adaptive_measures_the_image_stream_the_family_names_not_the_first_returned(toy):
    """Qwen-Image's and SD3's blocks return the text stream first; the text tokens change little between steps."""
    forward = cached(toy, mode="adaptive", threshold=1e9)
    img, txt = inputs(1)
    later = img * 1.05 + 0.1
    call(forward, img, txt, 1.0)
    call(forward, later, txt, 0.8)
    with torch.no_grad():
        (_, before), (_, after) = toy.pairs[0](img, txt), toy.pairs[0](later, txt)
    assert forward.step_cache.changes == [pytest.approx(relative_change(after, before))]


def test_a_cache_depth_the_model_does_not_have_is_refused_with_the_range(toy):
    with pytest.raises(DeepCacheConfigError, match=r"cache_depth must be in 1\.\.4"):
        cached(toy, cache_depth=5)
    with pytest.raises(DeepCacheConfigError, match="mode must be one of auto, fixed, adaptive, calibrated"):
        DeepCacheConfig(mode="sometimes")


def test_the_model_s_own_forward_is_back_after_each_call_even_when_it_fails(toy):
    forward = cached(toy, cache_interval=2)
    with pytest.raises(RuntimeError):
        call(forward, torch.randn(1, 6, 5), torch.randn(1, 3, 5), 1.0)  # wrong width
    assert all("forward" not in block.__dict__ for block in list(toy.pairs) + list(toy.singles))
    img, txt = inputs(1)
    assert torch.equal(call(forward, img, txt, 1.0), toy(img, txt))
    # The failed call ended before its step was decided (the first block): it counts in no run.
    stats = forward.step_cache.stats
    assert (stats.steps, stats.full_calls, stats.decisions) == (1, 1, [True])


def test_a_call_it_cannot_serve_raises_when_asked_to_and_leaves_the_model_as_it_was(toy):
    forward = cached(toy, cache_interval=2, on_unsupported="error")
    img, txt = inputs(1)
    with pytest.raises(DeepCacheUnsupportedError, match="the call carries no sigma.*on_unsupported='full'"):
        forward(img, txt, transformer_options={})
    assert all("forward" not in block.__dict__ for block in list(toy.pairs) + list(toy.singles))
    assert torch.equal(call(forward, img, txt, 1.0), toy(img, txt))  # a call it can serve still runs
