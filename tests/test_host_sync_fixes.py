"""HostSyncFix (families/__init__.py): the swap of a model-code function for one that does not block the host, made
only where the two agree on its probe, undone by uninstall, and left alone where the model's code differs."""
import logging
import sys
import types

import pytest
import torch

from overdrive.families import HostSyncFix


@pytest.fixture
def model_code():
    module = types.ModuleType("overdrive_test_model_code")
    module.embed = lambda dim, position: torch.outer(position, torch.arange(dim // 2).to(position))
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def same_on_the_device(dim, position):
    return torch.outer(position, torch.arange(dim // 2, device=position.device, dtype=position.dtype))


def test_a_fix_replaces_the_function_where_both_agree_and_uninstall_restores_it(model_code):
    original = model_code.embed
    fix = HostSyncFix(model_code.__name__, "embed", same_on_the_device, "test", probe=(8, torch.tensor([0.5, 3.0])))
    fix.install()
    assert model_code.embed is same_on_the_device
    fix.install()  # idempotent: the original stays the one to restore
    fix.uninstall()
    assert model_code.embed is original


def test_a_model_code_that_computes_something_else_keeps_its_function_with_one_warning(model_code, caplog):
    other = model_code.embed = lambda dim, position: 2 * same_on_the_device(dim, position)
    fix = HostSyncFix(model_code.__name__, "embed", same_on_the_device, "test", probe=(8, torch.tensor([0.5, 3.0])))
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        fix.install()
        fix.install()
    assert model_code.embed is other
    assert [r.getMessage() for r in caplog.records].count(
        "Overdrive: overdrive_test_model_code.embed is not the function its host-sync fix replaces (its output differs "
        "from the replacement's); it stays as it is") == 1


def test_another_signature_or_a_module_not_loaded_is_left_alone(model_code):
    model_code.embed = lambda position: position
    HostSyncFix(model_code.__name__, "embed", same_on_the_device, "test", probe=(8, torch.tensor([1.0]))).install()
    assert model_code.embed is not same_on_the_device
    HostSyncFix("overdrive_no_such_module", "embed", same_on_the_device, "test", probe=(8,)).install()
    assert "overdrive_no_such_module" not in sys.modules


def test_a_method_is_replaced_on_its_class_and_restored(model_code):
    class Patchifier:
        def coords(self, n):
            return torch.arange(n) * self.step

    def coords_elsewhere(self, n):
        return torch.arange(0, n * self.step, self.step)

    model_code.Patchifier, original = Patchifier, Patchifier.coords
    fix = HostSyncFix(model_code.__name__, "Patchifier.coords", coords_elsewhere, "test",
                      probe=(types.SimpleNamespace(step=3), 5))
    fix.install()
    assert Patchifier.coords is coords_elsewhere and fix.current() is coords_elsewhere
    fix.uninstall()
    assert Patchifier.coords is original
