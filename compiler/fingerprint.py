"""An architecture fingerprint: equal for two checkpoints of one architecture, never derived from weight values."""
import hashlib
import json

import torch


def _structure(module: torch.nn.Module) -> list:
    """Module tree (names and classes) plus parameter/buffer names, shapes and dtypes."""
    items = []
    for name, sub in module.named_modules():
        items.append(["m", name, f"{type(sub).__module__}.{type(sub).__qualname__}"])
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        items.append(["t", name, list(t.shape), str(t.dtype)])
    return items


def architecture_fingerprint(module: torch.nn.Module, extra: dict | None = None) -> str:
    """A short hex digest of the module's architecture and `extra` (e.g. compile options).

    Equal fingerprints mean a compiled graph traced on one module can serve the other: same classes,
    same parameter names, shapes and dtypes. Devices are left out on purpose: ComfyUI moves models
    between CPU and GPU, and Dynamo's own guards re-check devices at run time.
    """
    payload = json.dumps({"structure": _structure(module), "extra": extra or {}}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def describe(module: torch.nn.Module) -> str:
    """A human name for logs: class name and parameter count."""
    n = sum(p.numel() for p in module.parameters())
    return f"{type(module).__name__} ({n / 1e6:.1f}M parameters)"
