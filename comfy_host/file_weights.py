"""Float weights sent back to the file they were loaded from instead of into a copy in host memory.

Quantize Model's layers replace float layers that stay part of ComfyUI's model (a float clone of it may run next), but
must leave the GPU while the quantized model runs. Copied to the host, they cost a second copy of the float model in
anonymous memory per quantized model (bench/EXPERIMENTS.md). The file they came from is on disk, memory-mapped by ComfyUI or by
safetensors: a float layer whose tensors are found there, equal to what the model holds, points at the file's tensors
(page cache: the kernel reclaims it under pressure, nothing is copied) and is read back from the file when a float clone
loads it. What is found nowhere is copied to the host as before, and the log says how much.

Where the tensors are found: a model that records them (`record_file_tensors`: Compile Model's classic copy of a
dynamic-VRAM model shares the file's tensors), else the safetensors file ComfyUI's loader read the model from
(`ModelPatcher.cached_patcher_init`), under the key prefixes of a checkpoint or a diffusion-model file.
"""
import logging
import os
import weakref

import torch

from ..compiler.switch_weights import CHECKPOINT_PREFIXES

log = logging.getLogger("overdrive.quantization")
FILE_TENSORS = "overdrive_file_tensors"  # on a BaseModel: {"diffusion_model.<param>": the file's tensor}
PREFIX = "diffusion_model."
CHUNKS, CHUNK = 16, 256  # values compared with the file's, spread over the tensor, before it points at the file


def record_file_tensors(base_model, tensors: dict) -> None:
    """`tensors` ({"diffusion_model.<param>": tensor in a memory-mapped file}) are where `base_model`'s weights live."""
    setattr(base_model, FILE_TENSORS, tensors)


def source_file(patcher) -> str | None:
    """The safetensors file ComfyUI's loader read `patcher`'s model from, or None."""
    init = getattr(patcher, "cached_patcher_init", None)
    arguments = init[1] if init and len(init) > 1 else ()
    path = arguments[0] if arguments and isinstance(arguments[0], str) else None
    return path if path and path.lower().endswith((".safetensors", ".sft")) else None


class MappedFile:
    """One file's tensors, memory-mapped once while a quantized model that reads them lives (the followers hold it)."""

    def __init__(self, version: tuple):
        self.version, self.tensors = version, {}


class FileTensors(dict):
    """{key: the file's tensor}, holding its MappedFile."""

    def __init__(self, tensors: dict, mapped: MappedFile | None = None):
        super().__init__(tensors)
        self.mapped = mapped


_MAPPED: "weakref.WeakValueDictionary[str, MappedFile]" = weakref.WeakValueDictionary()


def _from_file(path: str, keys: list) -> FileTensors:
    """{key: the file's tensor (memory-mapped once per file while it is used)} for the `keys` ("diffusion_model.
    <param>") found in `path` under one of the checkpoint prefixes; empty when the file cannot be read."""
    from safetensors import safe_open
    try:
        stat = os.stat(path)
        mapped = _MAPPED.get(path)
        if mapped is None or mapped.version != (stat.st_size, stat.st_mtime_ns):
            mapped = _MAPPED[path] = MappedFile((stat.st_size, stat.st_mtime_ns))
        missing = [key for key in keys if key not in mapped.tensors]
        if missing:
            with safe_open(path, framework="pt", device="cpu") as opened:
                stored = set(opened.keys())
                prefix = next((p for p in CHECKPOINT_PREFIXES if any(p + k[len(PREFIX):] in stored for k in missing)),
                              None)
                if prefix is not None:
                    mapped.tensors.update({key: opened.get_tensor(prefix + key[len(PREFIX):]) for key in missing
                                           if prefix + key[len(PREFIX):] in stored})
        return FileTensors({key: mapped.tensors[key] for key in keys if key in mapped.tensors}, mapped)
    except Exception as error:  # noqa: BLE001 - a file moved or rewritten since: host copies, as before
        log.info("Overdrive quantization: %s could not be read back (%s).", path, str(error).splitlines()[0][:200])
    return FileTensors({})


def file_tensors(base_model, path: str | None, layers: dict) -> dict:
    """{"diffusion_model.<layer>.<param>": file tensor} for the parameters of `layers` ({name: float layer}): those
    `base_model` records, else those found in the safetensors file `path`."""
    keys = [f"{PREFIX}{name}.{param}" for name, layer in layers.items() for param, _ in layer.named_parameters()]
    recorded = getattr(base_model, FILE_TENSORS, None)
    if recorded is not None:
        return {key: recorded[key] for key in keys if key in recorded}
    return _from_file(path, keys) if path else {}


def same_values(tensor: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether `tensor` holds the file's `stored` tensor: its shape, dtype and CHUNKS runs of values spread over it (a
    LoRA changes the rows it patches; a switch, every value)."""
    if stored.shape != tensor.shape or stored.dtype != tensor.dtype or type(tensor) not in (torch.Tensor,
                                                                                          torch.nn.Parameter):
        return False
    flat, stored_flat = tensor.detach().reshape(-1), stored.reshape(-1)
    step = max(1, flat.numel() // CHUNKS)
    starts = range(0, flat.numel(), step)
    index = torch.cat([torch.arange(start, min(start + CHUNK, flat.numel())) for start in starts])
    return torch.equal(flat[index.to(flat.device)].cpu(), stored_flat[index])


def point_at_file(layers: dict, stored: dict, patched: set) -> int:
    """Each of `layers` ({name: float layer}) on the GPU whose parameters all have an equal tensor in the file
    (`stored`: {key: file tensor}) pointed at them. Host tensors are left alone: ComfyUI keeps state on its own (a
    dynamic-VRAM model's view of the file; a classic model's offloaded weights, pinned by their address, whose
    registration would outlive a tensor replaced under it). `patched`: keys whose values ComfyUI has patched in place
    right now (a LoRA; its backup restores them): their layers are left alone. Returns the bytes pointed at the file."""
    pointed = 0
    for name, layer in layers.items():
        slots = [(sub, param, tensor, ".".join(part for part in (PREFIX + name, sub_name, param) if part))
                 for sub_name, sub in layer.named_modules() for param, tensor in sub._parameters.items()
                 if tensor is not None]
        if not slots or any(key in patched or key not in stored or tensor.device.type != "cuda"
                            for *_, tensor, key in slots):
            continue
        if not all(same_values(tensor, stored[key]) for _, _, tensor, key in slots):
            continue
        for sub, param, tensor, key in slots:
            source = stored[key]
            sub._parameters[param] = torch.nn.Parameter(source, requires_grad=False)
            pointed += tensor.numel() * tensor.element_size()
    return pointed
