"""What this process may hold on a GPU: the figure Compile Model and Quantize Model size their work by."""
import torch

import comfy.model_management

from ..core.cuda_streams import allocator_limit_bytes

# Room kept free beside a model's weights for one uncompiled model call's activations, at least (ComfyUI's minimum
# inference memory less its reserve, which the budget already leaves out); a sampling's own estimate raises it.
ACTIVATIONS_BYTES = int(0.8 * 2**30)


def gpu_budget_bytes(device) -> int:
    """The card's memory less ComfyUI's reserve (--reserve-vram), capped by torch's per-process memory fraction where
    one is set (an emulated card sets both: the lower is the card)."""
    budget = comfy.model_management.get_total_memory(device) - comfy.model_management.EXTRA_RESERVED_VRAM
    if getattr(device, "type", None) == "cuda":
        budget = min(budget, allocator_limit_bytes(device))
    return int(budget)


def device_in_use(device) -> tuple:
    """(bytes in use on CUDA `device`, of which PyTorch's allocator holds): what the device reports used (ComfyUI's
    dynamic-VRAM weights live outside PyTorch's allocator, and so does the CUDA context) less what PyTorch caches
    unused, and at least what PyTorch allocated."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    return max(allocated, total - free - cached), allocated


def _cuda(device) -> torch.device | None:
    device = torch.device(device)
    return device if device.type == "cuda" and torch.cuda.is_available() else None


def room_for_weights(device, activations: int = ACTIVATIONS_BYTES) -> int | None:
    """Bytes of weights that may still come onto `device` (a CUDA GPU) beside what is in use there (device_in_use)
    and `activations` bytes kept free for a model call's working memory; None off CUDA (no budget to keep)."""
    if (device := _cuda(device)) is None:
        return None
    in_use, _ = device_in_use(device)
    return gpu_budget_bytes(device) - in_use - activations


def describe_room(device, activations: int = ACTIVATIONS_BYTES) -> str:
    """The figures room_for_weights reads, for a log line ("" off CUDA)."""
    if (device := _cuda(device)) is None:
        return ""
    (in_use, allocated), kept = device_in_use(device), activations
    return (f"card budget {gpu_budget_bytes(device) / 2**30:.2f} GiB, in use {in_use / 2**30:.2f} (PyTorch's "
            f"allocations {allocated / 2**30:.2f}), kept free for a model call {kept / 2**30:.2f}")
