"""Layers' weights copied from the host to the card one layer ahead of their use.

A plain `tensor.to("cuda")` from pageable memory (a memory-mapped checkpoint) is one thread faulting the file's pages
into the driver's staging buffer, then the copy, in turn. Here the host's threads (torch's CPU copy) fill one of two
page-locked buffers with the next layer while the card copies the layer before out of the other, so the file is read
at the speed of the host's cores and the card copies at DMA speed. The two buffers are page-locked for the run only
(bounded by twice the largest layer) and let go at its end.
"""
import contextlib
from typing import Iterable, Iterator

import torch

from .cuda_streams import side_stream

_ALIGN = 256  # bytes: each tensor's view in a buffer starts aligned for any dtype and for the copy engine


def on_device_ahead(layers: Iterable[tuple], device) -> Iterator[tuple]:
    """Each item of `layers` (a tuple of tensors or None) as the same tuple on `device`, in order, the next layer's
    copy under way while the caller works on this one. Off CUDA, or for a tensor that is not a plain one on the host
    (a checkpoint's low-bit tensor subclass, a tensor already on a device), each is a plain `.to(device)`."""
    layers = list(layers)
    device = torch.device(device)
    sizes = [sum(_aligned(t) for t in layer if _stageable(t, device)) for layer in layers]
    if device.type != "cuda" or not any(sizes):
        for layer in layers:
            yield tuple(None if t is None else t.to(device) for t in layer)
        return
    with _PinnedPair(max(sizes), device) as buffers:
        stream, current = side_stream(device), torch.cuda.current_stream(device)
        ahead = _issue(layers[0], buffers[0], device, stream, current)
        for index in range(len(layers)):
            copies, done = ahead
            if index + 1 < len(layers):  # the host fills the other buffer while the card copies this layer
                ahead = _issue(layers[index + 1], buffers[(index + 1) % 2], device, stream, current)
            current.wait_event(done)
            yield copies
            del copies  # the caller's turn is over: only the layer in flight stays referenced here


def _stageable(tensor, device) -> bool:
    return (tensor is not None and type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and device.type == "cuda" and tensor.numel() > 0)


def _aligned(tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN


def _issue(layer: tuple, buffer: "_Buffer", device, stream, current) -> tuple:
    """(the layer's tensors on `device`, the event their copies end with): each plain host tensor copied into `buffer`
    by the host (once the card has read the buffer's last layer out), then to the card on the side stream. The copies
    are allocated on the current stream, which uses them (the side stream first waits for the work queued there, which
    may still be reading the blocks they reuse)."""
    buffer.wait()
    copies, offset = [], 0
    stream.wait_stream(current)
    try:
        for tensor in layer:
            if not _stageable(tensor, device):
                copies.append(None if tensor is None else tensor.to(device))
                continue
            size = tensor.numel() * tensor.element_size()
            staged = buffer.block[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor.detach())
            on_device = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            with torch.cuda.stream(stream):
                on_device.copy_(staged, non_blocking=buffer.locked)
            on_device.record_stream(stream)
            copies.append(on_device)
            offset += _aligned(tensor)
    finally:  # also after a failure midway: the buffer is not let go while a queued copy may still read it
        buffer.read = torch.cuda.Event()
        buffer.read.record(stream)
    return tuple(copies), buffer.read


class _Buffer:
    def __init__(self, size: int):  # under the card's device context (`_PinnedPair`)
        self.block = torch.empty(size, dtype=torch.uint8)
        portable = 1  # cudaHostRegisterPortable: page-locked for every card, as ComfyUI pins its weights
        self.locked = torch.cuda.cudart().cudaHostRegister(self.block.data_ptr(), size, portable) == 0
        if not self.locked:  # no page-locked memory to be had: the copies run, synchronously
            _discard_last_error()
        self.read = None

    def wait(self) -> None:
        if self.read is not None:
            self.read.synchronize()

    def release(self) -> None:
        self.wait()
        if self.locked:
            torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr())
            self.locked = False


class _PinnedPair(contextlib.AbstractContextManager):
    def __init__(self, size: int, device):
        self.size, self.device = size, device
        self.buffers = []

    def __enter__(self):
        try:
            with torch.cuda.device(self.device):
                for _ in range(2):
                    self.buffers.append(_Buffer(self.size))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.buffers

    def __exit__(self, *exc):
        with torch.cuda.device(self.device):
            for buffer in self.buffers:
                buffer.release()
        return False


def _discard_last_error() -> None:
    """Clears a failed CUDA runtime call's error (the page-locking above), which the next kernel launch's check would
    otherwise report as its own."""
    try:
        torch.ones(1, device=torch.cuda.current_device()).add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
