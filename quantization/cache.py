"""Quantization decisions (JSON) on disk, so a later run skips calibration; optionally the quantized weights
(safetensors, `store_weights=True`). Without them a cache hit quantizes the chosen layers again from the float
weights with the cached input scales, which gives the same layers: on a GPU that is much faster, even for Flux, than
writing and checksumming its fp8 weights.

Key (storage.cache_key) = the model's weights digest (sha256 over every parameter and buffer: name, dtype, shape,
bytes), the settings (`QuantConfig`), the resolution bucket, the concrete format and the candidate layers, plus the
device identity (GPU model, capability, versions). Files: `<key>.decisions` (the report, as JSON and the weights file's sha256, in
storage's checksum framing) and `<key>.safetensors` beside it, both written atomically by `storage`; a file that
fails to parse or to match its checksum is logged, deleted and ignored: the caller re-calibrates. Nothing here raises
on a bad cache entry.
"""
from __future__ import annotations

import hashlib
import logging
import math
import pathlib

import torch

from ..core.storage import (CorruptEntry, atomic_file, cache_dir, cache_key, discard, file_sha256, read_framed_json, write_framed_json)
from .report import QuantReport

log = logging.getLogger("overdrive.quantization")
SCHEMA = 9  # 2: fp8 layers hold one weight scale per tensor (was per channel); 3: and a static input scale;
#            4: storage's framing; 5: decisions carry each layer's calibration amax; 6: a memory-bound layer may run
#            its 8-bit GEMM where that measured faster than weight-only storage; 7: each layer's own format (4 bits
#            fall back to 8 per layer); 8: ComfyUI keys decisions by the weights without their LoRAs; 9: layers
#            whose weights dynamic VRAM keeps on the host are timed too (float_twins.py)
REQUANTIZE = "its cached decisions stand, and the chosen layers are quantized again from the model's weights (no calibration)"
_TENSOR_NAMES = ("weight_q", "weight_scale", "group_scale", "bias", "input_scale")


def default_cache_dir() -> pathlib.Path:
    return cache_dir("quantization")


_CHUNK = 1 << 22  # elements hashed per step (a 32 MiB int64 buffer of coefficients per device)
_COEFFICIENTS: dict = {}


def _coefficients(device: torch.device) -> torch.Tensor:
    """Fixed odd 63-bit multipliers, made on the CPU so every device hashes the same bytes to the same value."""
    key = str(device)
    if key not in _COEFFICIENTS:
        generator = torch.Generator().manual_seed(0x0D5EED)
        odd = torch.randint(0, 2 ** 62, (_CHUNK,), generator=generator, dtype=torch.int64) * 2 + 1
        _COEFFICIENTS[key] = odd.to(device)
    return _COEFFICIENTS[key]


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_hash(tensor: torch.Tensor) -> int:
    """A 64-bit hash of a tensor's bytes, computed where the tensor lives (no copy to the host).

    The elements, read as integers, are multiplied by fixed odd position coefficients and summed modulo 2**64 (each
    chunk's sum by another odd factor): any single changed element changes the sum, and unrelated changes cancel with
    probability ~2**-64. Integer sums are exact, so the value does not depend on the device or reduction order."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    ints = flat.contiguous().view(_INT_VIEWS[flat.element_size()]).to(torch.int64)
    coefficients = _coefficients(flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for index, start in enumerate(range(0, ints.numel(), _CHUNK)):
        chunk = ints[start:start + _CHUNK]
        total += (chunk * coefficients[:chunk.numel()]).sum() * (2 * index + 1)
    return int(total)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer of `model`: names, dtypes, shapes and `tensor_hash` of the values.

    The calibration inputs of a layer depend on all weights upstream of it, so the whole model is hashed. Hashing on
    the weights' device is far faster than sha256 of the bytes on the host;
    callers that already know the model's identity can pass their own digest instead.
    """
    digest = hashlib.sha256()
    seen = set()
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        if tensor is None or name in seen:
            continue
        seen.add(name)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{tensor_hash(tensor)}\n".encode())
    return digest.hexdigest()


FINGERPRINT_CHUNK = 4096  # elements read at each of a tensor's start, middle and end


def weights_fingerprint(named_tensors) -> str:
    """sha256 over `(name, tensor)` pairs: names, dtypes, shapes and `tensor_hash` of three short chunks of each
    tensor (its start, middle and end). Two checkpoints of one architecture (fine-tunes, merges) differ in every chunk;
    reading a few pages per tensor keeps it fast where the weights are a memory-mapped file on the host, where hashing
    every byte is slow for a large model. Tensor subclasses (a checkpoint's stored low-bit layers) are hashed
    whole."""
    digest, samples = hashlib.sha256(), []
    for name, tensor in named_tensors:
        if tensor is None:
            continue
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            digest.update(f"{tensor_hash(tensor)}\n".encode())
            continue
        flat, middle = tensor.detach().reshape(-1), tensor.numel() // 2
        parts = [flat] if flat.numel() <= 3 * FINGERPRINT_CHUNK else [
            flat[:FINGERPRINT_CHUNK], flat[middle:middle + FINGERPRINT_CHUNK], flat[-FINGERPRINT_CHUNK:]]
        samples.extend(part.contiguous().view(torch.uint8) for part in parts)
    if samples:  # one hash, on the first sample's device (the same value anywhere): one wait, not one per tensor
        device = samples[0].device
        digest.update(f"{tensor_hash(torch.cat([part.to(device) for part in samples]))}\n".encode())
    return digest.hexdigest()


def resolution_bucket(resolution) -> str:
    """A cache bucket for the sampling resolution: pixels (batch x height x width) rounded to a power of two.

    `resolution`: None ("any"), a string (used as is), or a tuple of positive ints ((h, w) or (batch, h, w)).
    """
    if resolution is None:
        return "any"
    if isinstance(resolution, str):
        return resolution
    values = tuple(int(v) for v in resolution)
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"resolution={resolution!r}: give (height, width) or (batch, height, width), all > 0.")
    pixels = math.prod(values)
    return f"2^{round(math.log2(pixels))}px"


def decision_key(digest: str, config_dict: dict, fmt: str, bucket: str, device, candidates: list) -> str:
    return cache_key({"schema": SCHEMA, "weights": digest, "config": config_dict, "format": fmt, "resolution": bucket,
                      "candidates": candidates}, device, length=32)


class QuantCache:
    """`load(key)` -> QuantReport or None; `load_weights(key, device)`; `save(key, report, modules)`."""

    def __init__(self, directory=None, store_weights: bool = False):
        self.directory = pathlib.Path(directory) if directory else default_cache_dir()
        self.store_weights = store_weights

    def decisions_path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.decisions"

    def weights_path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.safetensors"

    def _discard(self, path: pathlib.Path, why, consequence: str):
        log.warning("Overdrive quantization: deleted the corrupt cache file %s (%s); %s.", path, why, consequence)
        discard(path)

    def _entry(self, key: str) -> dict | None:
        path = self.decisions_path(key)
        if not path.is_file():
            return None
        try:
            entry = read_framed_json(path)
            if entry.get("schema") != SCHEMA or entry.get("key") != key:
                raise CorruptEntry("wrong schema or key")
            entry["report_obj"] = QuantReport.from_dict(entry["report"])
            return entry
        except Exception as error:  # noqa: BLE001 - a bad cache entry must never stop a generation
            self._discard(path, error, "the layers are calibrated and measured again")
            return None

    def load(self, key: str) -> QuantReport | None:
        """The cached decisions for `key`, or None (missing or corrupt: then calibrate)."""
        entry = self._entry(key)
        return None if entry is None else entry["report_obj"]

    def load_weights(self, key: str, device) -> dict | None:
        """{layer name: {"weight_q", "weight_scale"[, "bias"][, "input_scale"]}} from `<key>.safetensors`, or None."""
        entry = self._entry(key)
        info = None if entry is None else entry.get("weights")
        path = self.weights_path(key)
        if not info or not path.is_file():
            return None
        try:
            if path.stat().st_size != info["bytes"] or file_sha256(path) != info["sha256"]:
                raise ValueError("size or sha256 mismatch (truncated or corrupt file)")
            from safetensors.torch import load_file
            flat = load_file(str(path), device=str(torch.device(device)))
        except Exception as error:  # noqa: BLE001
            self._discard(path, error, REQUANTIZE)
            return None
        layers = {}
        for name, tensor in flat.items():
            layer, _, tensor_name = name.rpartition(".")
            if tensor_name not in _TENSOR_NAMES:
                self._discard(path, f"unexpected tensor {name!r}", REQUANTIZE)
                return None
            layers.setdefault(layer, {})[tensor_name] = tensor
        return layers

    def _save_weights(self, key: str, modules: dict) -> dict:
        from safetensors.torch import save_file
        flat = {f"{name}.{tensor_name}": tensor.detach().contiguous().cpu()
                for name, module in modules.items() for tensor_name, tensor in module.quantized_state().items()}
        with atomic_file(self.weights_path(key)) as tmp:
            save_file(flat, str(tmp), metadata={"overdrive": "quantized weights", "key": key})
            return {"sha256": file_sha256(tmp), "bytes": tmp.stat().st_size}

    def save(self, key: str, report: QuantReport, modules: dict | None = None) -> pathlib.Path | None:
        """Write the decisions (and the quantized tensors of `modules`) atomically; never raises."""
        try:
            weights = None
            if self.store_weights and modules:
                weights = self._save_weights(key, modules)
            path = self.decisions_path(key)
            write_framed_json(path, {"schema": SCHEMA, "key": key, "report": report.to_dict(), "weights": weights})
            return path
        except Exception as error:  # noqa: BLE001 - a cache that cannot be written only costs a re-calibration
            log.warning("Overdrive quantization: could not write the decision cache in %s (%s).", self.directory, error)
            return None
