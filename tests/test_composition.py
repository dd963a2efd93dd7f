"""Overdrive's nodes chained with ComfyUI's own accelerators and with other extensions' hooks, in both orders, on the
built-in tiny Flux.1 file, ComfyUI's loader and sampler (CPU): another extension's APPLY_MODEL wrapper, a block
replacement (PuLID-style `patches_replace["dit"]`) and ComfyUI's EasyCache. Each combination either runs as documented
(per model call against eager with the same hook) or says why it does not in the log."""
import logging

import pytest
import torch

from test_dit_families import (PER_CALL_TOLERANCE, assert_calls_match, base, eager, first_file,  # noqa: F401
                               models_folder, nodes, relative_error, sample)

SCALE = 0.5  # what the other extension's wrapper does to each model output: visible in every call


@pytest.fixture(scope="module")
def family():
    return "flux"


class OtherExtension:
    """A second extension that wraps ComfyUI's APPLY_MODEL (as IP-Adapter managers, samplers' guidance tools do):
    counts its calls and scales the output."""

    def __init__(self):
        self.calls = 0

    def __call__(self, executor, *args, **kwargs):
        self.calls += 1
        return executor(*args, **kwargs) * SCALE

    def on(self, model):
        from comfy.patcher_extension import WrappersMP
        wrapped = model.clone()
        wrapped.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "other_extension", self)
        return wrapped


def with_double_block_0_replaced(model, seen):
    """A block replacement as PuLID-style nodes install it: Flux's first double block runs through a function that
    calls the original block and nudges its image stream."""
    def replace(args, extra):
        seen.append(1)
        out = extra["original_block"](args)
        return {**out, "img": out["img"] * 0.9}
    patched = model.clone()
    patched.set_model_patch_replace(replace, "dit", "double_block", 0)
    return patched


@pytest.fixture(scope="module")
def eager_replaced(base, sample):
    """(calls of eager with the block replaced, how many times the replacement ran)."""
    seen = []
    _, calls = sample(with_double_block_0_replaced(base, seen))
    return calls, len(seen)


@pytest.fixture(scope="module")
def eager_wrapped(base, sample):
    extension = OtherExtension()
    out, calls = sample(extension.on(base))
    assert extension.calls == len(calls) > 0
    return out, calls


@pytest.mark.parametrize("order", ["wrapper first", "compile first"])
def test_another_extensions_apply_model_wrapper_runs_around_the_compiled_model(nodes, base, sample, eager_wrapped,
                                                                               order):
    extension = OtherExtension()
    compile_model = nodes["OverdriveCompileModel"].execute
    model = compile_model(extension.on(base))[0] if order == "wrapper first" else extension.on(compile_model(base)[0])
    out, calls = sample(model)
    assert extension.calls == len(calls)
    assert_calls_match(calls, eager_wrapped[1], PER_CALL_TOLERANCE)


@pytest.mark.parametrize("order", ["wrapper first", "cache first"])
def test_another_extensions_apply_model_wrapper_runs_around_the_step_cache(nodes, base, sample, eager_wrapped, order):
    extension = OtherExtension()
    step_cache = nodes["OverdriveDeepCache"].execute
    model = (step_cache(extension.on(base), mode="fixed", cache_interval=2)[0] if order == "wrapper first"
             else extension.on(step_cache(base, mode="fixed", cache_interval=2)[0]))
    out, calls = sample(model)
    assert extension.calls == len(calls)
    assert_calls_match(calls[:1], eager_wrapped[1][:1], PER_CALL_TOLERANCE)  # the first step runs in full
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("order", ["replacement first", "compile first"])
def test_a_block_replacement_runs_inside_the_compiled_model(nodes, base, sample, eager, eager_replaced, order):
    expected, runs = eager_replaced
    seen = []
    compile_model = nodes["OverdriveCompileModel"].execute
    model = (compile_model(with_double_block_0_replaced(base, seen))[0] if order == "replacement first"
             else with_double_block_0_replaced(compile_model(base)[0], seen))
    out, calls = sample(model)
    assert len(seen) == runs == len(calls)  # the replacement ran at every call
    assert_calls_match(calls, expected, PER_CALL_TOLERANCE)
    assert relative_error(calls[0][2], eager[1][0][2]) > 1e-3  # and it mattered


def test_a_block_replacement_makes_the_step_cache_run_every_block_and_says_so(nodes, base, sample, eager_replaced,
                                                                              caplog):
    expected, runs = eager_replaced
    seen = []
    cached = with_double_block_0_replaced(
        nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=2)[0], seen)
    with caplog.at_level(logging.INFO, logger="overdrive"):
        out, calls = sample(cached)
        sample(cached)  # the first run's full / reused steps are logged when the next starts
    assert "a node patches this model's blocks" in caplog.text, caplog.text[-2000:]
    assert len(seen) == 2 * runs
    assert_calls_match(calls, expected, PER_CALL_TOLERANCE)  # every step ran in full


@pytest.mark.parametrize("order", ["easycache first", "compile first"])
def test_comfyuis_easycache_with_compile_model(nodes, base, sample, order):
    from comfy_extras.nodes_easycache import EasyCacheNode

    def easycache(model):
        return EasyCacheNode.execute(model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95,
                                     verbose=False)[0]
    expected, _ = sample(easycache(base))
    compile_model = nodes["OverdriveCompileModel"].execute
    model = compile_model(easycache(base))[0] if order == "easycache first" else easycache(compile_model(base)[0])
    out, _ = sample(model)
    assert relative_error(out, expected) < PER_CALL_TOLERANCE * 10
