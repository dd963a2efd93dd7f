"""Float weights sent back to the file they were loaded from instead of into a copy in host memory.

Quantize Model's layers replace float layers that stay part of ComfyUI's model (a float clone of it may run next), but
must leave the GPU while the quantized model runs. Copied to the host, the float layers of Flux.1 took 23 GB of
anonymous memory per quantized model, on desktops of 32-64 GB. The file they came from is on disk, memory-mapped by ComfyUI or by
safetensors: a float layer whose tensors are found there, equal to what the model holds, points at the file's tensors
(page cache: the kernel reclaims it under pressure, nothing is copied) and is read back from the file when a float clone
loads it. What is found nowhere is copied to the host as before, and the log says how much.

Where the tensors are found: a model that records them (`record_file_tensors`: Compile Model's classic copy of a
dynamic-VRAM model shares the file's tensors), else the safetensors file ComfyUI's loader read the model from
(`ModelPatcher.cached_patcher_init`), under the key prefixes of a checkpoint or a diffusion-model file.
"""
import logging

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


def _from_file(path: str, keys: list) -> dict:
    """{key: the file's tensor (memory-mapped)} for the `keys` ("diffusion_model.<param>") found in `path` under one
    of the checkpoint prefixes; {} when the file cannot be read."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt", device="cpu") as opened:
            stored = set(opened.keys())
            for prefix in CHECKPOINT_PREFIXES:
                found = {key: prefix + key[len(PREFIX):] for key in keys if prefix + key[len(PREFIX):] in stored}
                if found:
                    return {key: opened.get_tensor(name) for key, name in found.items()}
    except Exception as error:  # noqa: BLE001 - a file moved or rewritten since: host copies, as before
        log.info("Overdrive quantization: %s could not be read back (%s).", path, str(error).splitlines()[0][:200])
    return {}


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


def point_at_file(layers: dict, stored: dict, patched: set, host_copies: bool) -> int:
    """Each of `layers` ({name: float layer}) whose parameters all have an equal tensor in the file (`stored`: {key:
    file tensor}) pointed at them: those on the GPU, and with `host_copies` those in host memory too (a classic model's
    copies made by ComfyUI's unloading; a dynamic-VRAM model's host tensors are its own view of the file, which its
    loader keeps state on). `patched`: keys whose values ComfyUI has patched in place right now (a LoRA; its backup
    restores them): their layers are left alone. Returns the bytes that point at the file now and did not before."""
    pointed = 0
    for name, layer in layers.items():
        slots = [(sub, param, tensor, ".".join(part for part in (PREFIX + name, sub_name, param) if part))
                 for sub_name, sub in layer.named_modules() for param, tensor in sub._parameters.items()
                 if tensor is not None]
        if not slots or any(key in patched or key not in stored or tensor.is_meta or
                            (tensor.device.type == "cpu" and not host_copies) for *_, tensor, key in slots):
            continue
        fresh = [(sub, param, tensor, stored[key]) for sub, param, tensor, key in slots
                 if tensor.data_ptr() != stored[key].data_ptr()]
        if not all(same_values(tensor, source) for _, _, tensor, source in fresh):
            continue
        for sub, param, tensor, source in fresh:
            sub._parameters[param] = torch.nn.Parameter(source, requires_grad=False)
            pointed += tensor.numel() * tensor.element_size()
    return pointed
