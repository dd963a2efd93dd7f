"""The GPU memory a node's work peaked at, for its log line: on a card the model only partly fits, what decides
whether the work stays inside ComfyUI's budget."""
import contextlib

import torch


@contextlib.contextmanager
def peak_memory(device):
    """Yields a dict whose "text" is filled at exit: "peak X GiB allocated of Y GiB" for a CUDA `device` (PyTorch's
    allocator, which also holds what ComfyUI loads), else empty."""
    measured = {"text": ""}
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield measured
    finally:
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            limit = total * torch.cuda.get_per_process_memory_fraction(device) \
                if hasattr(torch.cuda, "get_per_process_memory_fraction") else total
            measured["text"] = (f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated of "
                                f"{limit / 2**30:.1f} GiB")
