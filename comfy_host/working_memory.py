"""What a quantized model's sampling runs need on the GPU beside its weights, measured: PyTorch's peak over a sampling
run less what was allocated as it began and the streamed layers' copies in flight, from the second run of a kind on
(the first compiles, times the attention kernels and records CUDA graphs: one-time peaks). The next load places the
quantized layers with that (and a margin) kept free instead of ComfyUI's estimate of an uncompiled call's activations
plus the compiled floor, which kept a 4-bit Flux that fits an 8 GiB card whole streaming part of its layers."""
import logging

import torch

log = logging.getLogger("overdrive.quantization")

# Kept free beyond the measured peak: a later run of the same size may allocate in other pieces.
MARGIN_FRACTION = 0.25
MARGIN_MIN_BYTES = 256 * 2**20


class MeasuredWorkingMemory:
    """Per sampling kind (`key`: the latent's shape, ComfyUI's estimate for its conditioning, compiled or not): the
    largest working memory measured, in bytes. `begin` and `end` bracket one sampling run on a CUDA device."""

    def __init__(self):
        self.measured = {}
        self.completed = {}  # key -> completed runs, measured or not
        self.refused = set()  # keys whose measured reserve left too little room for loading: the estimate for good
        self.run = None  # (key, device, allocated at the start) of the run in progress

    def reserve(self, key) -> int | None:
        """Bytes to keep free for a run of `key`: the measured peak and its margin; None before one was measured."""
        if (peak := self.measured.get(key)) is None or key in self.refused:
            return None
        return peak + max(MARGIN_MIN_BYTES, int(peak * MARGIN_FRACTION))

    def begin(self, key, device) -> None:
        device = torch.device(device)
        measured = device.type == "cuda" and torch.cuda.is_available() and self.completed.get(key, 0) > 0
        if measured:
            torch.cuda.reset_peak_memory_stats(device)
        self.run = (key, device, torch.cuda.memory_allocated(device) if measured else None)

    def end(self, in_flight: int) -> None:
        """After a completed run: its working memory, less `in_flight` bytes of streamed copies, kept if larger."""
        if self.run is None:
            return
        (key, device, start), self.run = self.run, None
        self.completed[key] = self.completed.get(key, 0) + 1
        if start is None:
            return
        used = max(0, torch.cuda.max_memory_allocated(device) - start - in_flight)
        if used > self.measured.get(key, -1):
            if key not in self.measured:
                log.info("Overdrive quantization: a sampling run at latent %s used %.2f GiB of GPU memory beside its "
                         "weights (streamed copies left out); the next load keeps %.2f GiB free for it.",
                         "×".join(map(str, key[0])), used / 2**30,
                         (used + max(MARGIN_MIN_BYTES, int(used * MARGIN_FRACTION))) / 2**30)
            self.measured[key] = used

    def refuse(self, key) -> bool:
        """Placing by `key`'s measured reserve ran out of memory: ComfyUI's estimate from now on. False where there
        was no measured reserve to drop."""
        if self.reserve(key) is None:
            return False
        self.refused.add(key)
        return True

    def abandon(self) -> None:
        """A run that did not complete (an interrupt or an error) measures nothing."""
        self.run = None
