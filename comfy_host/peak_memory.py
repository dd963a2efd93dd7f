"""The GPU memory a node's work peaked at, for its log line: on a card the model only partly fits, what decides
whether the work stays inside ComfyUI's budget."""
import contextlib

import torch

from .gpu_budget import gpu_budget_bytes


@contextlib.contextmanager
def peak_memory(device):
    """Yields a dict whose "text" is filled at exit: "peak X GiB allocated of Y GiB" for a CUDA `device`, else empty.
    The peak is PyTorch's allocator's (ComfyUI's dynamic-VRAM weights live outside it); Y is the card's budget."""
    measured = {"text": ""}
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield measured
    finally:
        if cuda:
            measured["text"] = (f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated of "
                                f"{gpu_budget_bytes(device) / 2**30:.1f} GiB")
