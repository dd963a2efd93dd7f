"""One side CUDA stream per device for the whole process, where Overdrive runs GEMMs off the current stream (CUDA-graph
capture, timing a kernel). cuBLAS keeps a workspace for every stream it has run on until the process ends: a new
stream per compiled model or per timed layer kept that memory on the card after each model was unloaded.

Also the two states of the GPU that Overdrive's fallbacks tell apart from a fault of the code that ran: a CUDA graph
being recorded, and the card out of memory at that moment; and the room the allocator has left on the card."""
import torch

_streams: dict = {}


def _indexed(device) -> torch.device:
    device = torch.device("cuda") if device is None else torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def side_stream(device=None) -> torch.cuda.Stream:
    device = _indexed(device)
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]


def replace_side_stream(device=None) -> None:
    """After a failed CUDA-graph capture on it: later work gets a new stream (CUDA ends an invalidated capture, but a
    stream that has been through one is not trusted with the next)."""
    _streams.pop(_indexed(device), None)


def capturing() -> bool:
    """Whether the current stream is recording a CUDA graph: a failure there (out of memory for the graph's pool) says
    nothing about the code that ran, so a fallback that would give up that code lets it through to the recorder."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def allocator_limit_bytes(device) -> int:
    """What torch's allocator may hold on `device`: the card's memory, times torch's per-process memory fraction where
    one is set (an emulated smaller card sets it)."""
    device = _indexed(device)
    fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.10
    return int((fraction_of(device) if fraction_of is not None else 1.0)
               * torch.cuda.get_device_properties(device).total_memory)


def room_bytes(device) -> int:
    """Bytes the allocator may still take from `device` for new segments: the card's free memory, within
    allocator_limit_bytes."""
    device = _indexed(device)
    free = torch.cuda.mem_get_info(device)[0]
    return int(min(free, allocator_limit_bytes(device) - torch.cuda.memory_reserved(device)))


def give_back_cache_if_short(device, need: int) -> None:
    """Before a CUDA-graph capture that will allocate about `need` bytes: the graph's pool cannot take blocks the
    allocator caches for ordinary allocations (a recording's warm-up just left its working memory cached on the side
    stream), and inside the capture the allocator cannot return them to the card either. Where the card has less
    room than that, the cache goes back first: a short card otherwise ran out of memory inside the capture with
    gigabytes cached and unused."""
    device = _indexed(device)
    if room_bytes(device) < need:
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the card running out of memory (torch's error, or a kernel library's that says so)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
