"""Models with an Overdrive forward sample with their conds moved to the sampling device once (comfy_host/conds_on_device):
ComfyUI's own cond objects, a real sampling on the tiny SD1.5 model, and the wrapper's bookkeeping on the patcher."""
import pytest
import torch

from test_deepcache_node import deepcache, sample  # noqa: F401
from test_nodes_inprocess import base, nodes  # noqa: F401


@pytest.fixture(scope="module")
def conds_on_device(comfy):
    from overdrive.comfy_host import conds_on_device
    return conds_on_device


def sampler_wrappers(model, key):
    from comfy.patcher_extension import WrappersMP
    return model.get_wrappers(WrappersMP.SAMPLER_SAMPLE, key)


def test_each_kind_of_model_cond_moves_and_the_original_entry_is_untouched(conds_on_device):
    import comfy.conds

    context, pooled, parts = torch.randn(1, 5, 8), torch.randn(1, 4), [torch.randn(1, 3), torch.randn(1, 2)]
    entry = {"model_conds": {"c_crossattn": comfy.conds.CONDCrossAttn(context), "y": comfy.conds.CONDRegular(pooled),
                             "parts": comfy.conds.CONDList(parts), "guidance": comfy.conds.CONDConstant(3.5)},
             "strength": 0.7}
    before = dict(entry["model_conds"])

    moved = conds_on_device.cond_on(entry, torch.device("meta"))

    assert moved["strength"] == 0.7 and set(moved["model_conds"]) == set(before)
    assert entry["model_conds"] == before and before["c_crossattn"].cond is context  # the caller's entry as it was
    for name in ("c_crossattn", "y"):
        assert type(moved["model_conds"][name]) is type(before[name])
        assert moved["model_conds"][name].cond.device.type == "meta"
        assert moved["model_conds"][name].cond.shape == before[name].cond.shape
    assert [t.device.type for t in moved["model_conds"]["parts"].cond] == ["meta", "meta"]
    assert moved["model_conds"]["guidance"] is before["guidance"]  # a plain value stays as it is
    assert conds_on_device.cond_on({"strength": 1.0}, torch.device("meta")) == {"strength": 1.0}


def test_sampling_runs_on_moved_copies_and_gives_the_guider_its_conds_back(base, sample, conds_on_device):
    from comfy.patcher_extension import WrappersMP

    model = deepcache(base, interval=1)  # exact: any Overdrive forward installs the wrapper
    seen = {}

    def outer(executor, guider, sigmas, *args, **kwargs):
        seen["before"] = guider.conds
        try:
            return executor(guider, sigmas, *args, **kwargs)
        finally:
            seen["after"] = guider.conds

    def inner(executor, guider, sigmas, *args, **kwargs):
        seen["during"], seen["device"] = guider.conds, sigmas.device
        return executor(guider, sigmas, *args, **kwargs)
    model.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, "test_outer", outer)
    conds_on_device.add(model)  # again: now after (inside) the test's outer wrapper
    model.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, "test_inner", inner)

    latent = sample(model)

    assert seen["after"] is seen["before"] and seen["during"] is not seen["before"]
    moved = 0
    for name, entries in seen["during"].items():
        for during, before in zip(entries, seen["before"][name], strict=True):
            for key, value in during["model_conds"].items():
                if isinstance(getattr(value, "cond", None), torch.Tensor):
                    assert value is not before["model_conds"][key] and value.cond.device == seen["device"]
                    moved += 1
    assert moved >= 2  # cond and uncond's context at least
    assert torch.equal(latent, sample(base.clone()))


def test_one_wrapper_however_many_overdrive_nodes_and_none_on_the_input_model(nodes, base, conds_on_device):
    compiled = nodes["OverdriveCompileModel"].execute(base)[0]
    both = deepcache(compiled, interval=2)
    assert len(sampler_wrappers(compiled, conds_on_device.KEY)) == 1
    assert len(sampler_wrappers(both, conds_on_device.KEY)) == 1
    assert sampler_wrappers(base, conds_on_device.KEY) == []
