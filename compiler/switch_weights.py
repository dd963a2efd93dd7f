"""Another checkpoint's weights for an already compiled architecture, without recompiling.

`twin_with_weights` builds a new module of the same structure whose parameters are the new weights (cast to
the running dtypes): it runs through the same shared compiled graphs (its weights are graph inputs), and the
model it came from is never touched. `copy_weights_` is the in-place variant for owners of a module
(diffusers pipelines), under a lock so no call ever sees half-swapped weights.
"""
import contextlib
import copy
import logging
import threading

import torch
from safetensors import safe_open

from ..core.errors import OverdriveError

SWITCH_LOCK = threading.RLock()
log = logging.getLogger("overdrive")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # those checked for NaN and Inf


class WeightMismatchError(OverdriveError, ValueError):
    """The checkpoint does not fit the running architecture; the message names the keys and shapes."""


def _listing(items, limit=5) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def check_compatible(reference: dict, state: dict, source: str = "checkpoint") -> None:
    """Raise WeightMismatchError unless `state` has exactly the keys and shapes of `reference` (name → tensor)."""
    missing = sorted(set(reference) - set(state))
    unexpected = sorted(set(state) - set(reference))
    wrong_shape = [f"{k}: {tuple(state[k].shape)} vs {tuple(reference[k].shape)}"
                   for k in sorted(set(reference) & set(state)) if tuple(state[k].shape) != tuple(reference[k].shape)]
    if missing or unexpected or wrong_shape:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing keys: {_listing(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected keys: {_listing(unexpected)}")
        if wrong_shape:
            problems.append(f"{len(wrong_shape)} keys with other shapes (checkpoint vs model): {_listing(wrong_shape, 3)}")
        raise WeightMismatchError(
            f"{source} does not match the running model's architecture: " + "; ".join(problems)
            + ". Choose a checkpoint of the same architecture (e.g. an SDXL fine-tune for an SDXL model); "
              "the running model was left unchanged.")


def not_finite(tensors: dict) -> list:
    """The names of the float tensors holding NaN or Inf: one isfinite reduction each, on the device the tensor is on,
    read back once per device (stored-quantized payloads are not checked; their float scales are)."""
    flags = {}
    for name, tensor in tensors.items():
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.dtype in FLOAT_DTYPES and not tensor.is_meta:
            flags.setdefault(tensor.device, []).append((name, torch.isfinite(tensor).all()))
    bad = []
    for entries in flags.values():
        finite = torch.stack([flag for _, flag in entries]).tolist()
        bad += [name for (name, _), ok in zip(entries, finite) if not ok]
    return sorted(bad)


def warn_if_not_finite(tensors: dict, source: str) -> None:
    """One warning naming the layers whose new weights hold NaN or Inf. They are used all the same: the file is the
    user's to judge, and a model with a few bad layers still runs."""
    bad = not_finite(tensors)
    if bad:
        log.warning("Overdrive: %d of the %d weight tensors of %s hold NaN or Inf (%s): images made with them are "
                    "likely black or noise. The weights were switched as asked; check the file.", len(bad),
                    len(tensors), source, _listing(bad))


def reference_tensors(module: torch.nn.Module) -> dict:
    return dict(module.state_dict(keep_vars=True))


def unreadable(path, error: Exception) -> WeightMismatchError:
    """The error for a checkpoint file that cannot be read (truncated, still downloading, not safetensors)."""
    reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    return WeightMismatchError(
        f"{path} could not be read ({reason}): the file is damaged, truncated (an unfinished download or copy) or not "
        f"a checkpoint. Download or copy it again. The running model was left unchanged.")


CHECKPOINT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # full checkpoint, diffusion model, bare


def module_keys(keys, reference: dict, path, prefixes=CHECKPOINT_PREFIXES) -> dict:
    """{module key: file key} under the first prefix that holds at least half of the module's keys; raises
    WeightMismatchError naming the file when none does."""
    for prefix in prefixes:
        names = {k[len(prefix):]: k for k in keys if k.startswith(prefix)}
        if len(set(names) & set(reference)) >= max(1, len(reference) // 2):
            return names
    raise WeightMismatchError(f"{path} has no weights for this model under any of the prefixes {list(prefixes)}: it "
                              "is not a checkpoint of this architecture. The running model was left unchanged.")


def read_safetensors_subset(path, reference: dict, prefixes=CHECKPOINT_PREFIXES) -> dict:
    """The tensors of `path` that belong to the module, under the first key prefix that matches it."""
    return read_safetensors_files([path], reference, prefixes, name=path)


def read_safetensors_files(paths, reference: dict, prefixes=CHECKPOINT_PREFIXES, name=None) -> dict:
    """The same from one checkpoint stored in several files (a diffusers model's shards); `name` names it in errors."""
    with contextlib.ExitStack() as opened:
        try:
            files = {path: opened.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in paths}
            where = {key: f for f in files.values() for key in f.keys()}
            names = module_keys(list(where), reference, name or paths[0], prefixes)
            return {module_key: where[key].get_tensor(key) for module_key, key in names.items()}
        except WeightMismatchError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors' own errors name neither the file nor the consequence
            raise unreadable(name or paths[0], error) from error


def _cast_like(state: dict, reference: dict) -> dict:
    # Always the running dtype: a switch never silently changes precision, and dtype guards never recompile.
    return {k: v.to(dtype=reference[k].dtype) for k, v in state.items()}


def twin_with_weights(module: torch.nn.Module, state: dict, source: str = "checkpoint",
                      loader_state: tuple = ()) -> torch.nn.Module:
    """A structural copy of `module` holding `state` as its weights (validated, cast), sharing no tensors with it.
    `loader_state`: see `structural_copy`."""
    reference = reference_tensors(module)
    check_compatible(reference, state, source)
    state = _cast_like(state, reference)
    warn_if_not_finite(state, source)  # in the running dtype: a cast can overflow to Inf
    replacements = {}
    for name, tensor in reference.items():  # deepcopy uses these instead of copying the old weights
        new = state[name]
        replacements[id(tensor)] = torch.nn.Parameter(new, requires_grad=False) \
            if isinstance(tensor, torch.nn.Parameter) else new
    return structural_copy(module, replacements, loader_state)


def structural_copy(module: torch.nn.Module, replacements: dict, loader_state: tuple = ()) -> torch.nn.Module:
    """A copy of `module` in which each object whose id is a key of `replacements` is that value instead (its tensors:
    nothing of the old weights is copied). Instance-level forwarders (compiled methods shadowing the class's own)
    are not copied; other callables the model keeps as attributes (LTX-Video's frequency-grid function) are part of
    the model and are. `loader_state`: names of attributes a host's loader keeps on each submodule about its own loads
    (handles to pinned host memory, say); they belong to `module`'s load and are left out of the copy (a module that
    `replacements` gives is shared, not copied, and keeps its own)."""
    memo = dict(replacements)
    shared = {id(value) for value in replacements.values()}
    for sub in module.modules():
        for name in loader_state:
            if name in sub.__dict__:
                memo[id(sub.__dict__[name])] = None
    for attr, value in module.__dict__.items():
        if (not attr.startswith("_") and callable(value) and not isinstance(value, torch.nn.Module)
                and hasattr(type(module), attr)):
            memo[id(value)] = None
    twin = copy.deepcopy(module, memo)
    for attr in [a for a, v in twin.__dict__.items() if v is None and callable(getattr(module, a, None))]:
        del twin.__dict__[attr]
    for sub in twin.modules():
        if id(sub) not in shared:
            for name in loader_state:
                sub.__dict__.pop(name, None)
    return twin


@torch.no_grad()
def copy_weights_(module: torch.nn.Module, state: dict, source: str = "checkpoint", reference: dict | None = None,
                  rebuild=None) -> None:
    """Copy `state` into `module`'s own tensors in place (validated first: on a mismatch nothing is written).

    reference: name -> tensor to validate against and copy into (default: the module's state dict); meta tensors in
    it stand for layers that `rebuild()` re-creates from `state` under the same lock (quantized layers)."""
    reference = reference_tensors(module) if reference is None else reference
    check_compatible(reference, state, source)
    with SWITCH_LOCK:
        for name, tensor in reference.items():
            if not tensor.is_meta:
                tensor.copy_(state[name], non_blocking=True)
        if rebuild is not None:
            rebuild()
        if any(t.is_cuda for t in reference.values()):
            torch.cuda.synchronize()
    # What now runs: the module's own tensors (cast on copy), the file's where a layer is re-created from it.
    warn_if_not_finite({name: state[name] if tensor.is_meta else tensor for name, tensor in reference.items()}, source)
