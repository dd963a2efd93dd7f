"""The quantized layers' home in page-locked host memory: while ComfyUI has their model loaded the GPU holds a copy,
and an unload copies them out into that home instead of into newly allocated pageable memory.

ComfyUI unloads a quantized model whenever another model needs room it cannot free from it (a VAE decode on a 16 GiB
card beside Flux's 8-bit layers, at every prompt): the 8-bit layers are Overdrive's tensors, not ComfyUI's weights,
so its partial unload finds nothing to free and it unloads the whole model. Copying 12 GiB out to freshly allocated
pageable memory and back took most of such a prompt (bench/experiments/loras-on-quantized-layers.md). Here the first
unload allocates each layer's block once in memory registered with CUDA (exact sizes: PyTorch's pinned allocator
rounds each block up to a power of two), every unload copies into it at the card's copy rate, and a load is one
asynchronous copy in. The pinned copies are the layers' size in host memory, where the unloaded layers lived anyway;
they go with their layer (the registry is keyed weakly), and StreamedBlocks streams from them on a short card.
"""
import logging
import weakref

import torch

from .layer_tensors import tensors_of

log = logging.getLogger("overdrive.quantization")
ALIGN = 256  # bytes: each tensor's offset in a layer's block, so that every dtype's view is aligned


class HomeOfLayer:
    """One layer's page-locked block and its views, in the order of the layer's tensor slots."""

    def __init__(self, layer: torch.nn.Module):
        slots = tensors_of(layer)
        offsets, size = [], 0
        for *_, tensor in slots:
            offsets.append(size)
            size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        with torch.inference_mode(False):  # written again outside a prompt too (/free unloads from the server thread)
            self.block = torch.empty(max(size, 1), dtype=torch.uint8)
            self.views = [self.block[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype)
                          .view(tensor.shape) for offset, (*_, tensor) in zip(offsets, slots)]
        self.registered = register(self.block)
        self.shapes = [(tensor.dtype, tensor.shape) for *_, tensor in slots]
        self.nbytes = size
        if self.registered:
            weakref.finalize(self, unregister, self.block)

    def fits(self, slots) -> bool:
        return [(tensor.dtype, tensor.shape) for *_, tensor in slots] == self.shapes


class PinnedHome:
    """`send(layers)` at an unload, `bring(layers, device)` at a load; layers without a home move as modules do."""

    def __init__(self):
        self.homes: "weakref.WeakKeyDictionary[torch.nn.Module, HomeOfLayer]" = weakref.WeakKeyDictionary()
        self.logged = False

    def nbytes(self) -> int:
        return sum(home.nbytes for home in self.homes.values())

    def views(self, layer) -> list:
        """(submodule, kind, name, page-locked tensor) of `layer`, holding its current data."""
        self.send([layer], keep_on_card=True)
        slots = tensors_of(layer)
        return [(sub, kind, name, view) for (sub, kind, name, _), view in zip(slots, self.homes[layer].views)]

    def send(self, layers, keep_on_card: bool = False) -> int:
        """Each layer's data into its home, then (unless `keep_on_card`) its slots point there: the GPU copies go back
        to PyTorch's cache. A slot that holds its home already copies nothing (8-bit layers are written in place,
        Switch Weights among them, and 8-bit weights made under inference mode keep no version to tell a write by, so
        a GPU copy is always copied out). Returns the bytes copied."""
        copied, sources = 0, set()
        try:
            with torch.no_grad():
                for layer in layers:
                    copied += self._send_layer(layer, keep_on_card, sources)
        finally:
            for device in sources:  # the host copies are read (and the GPU memory reused) only after this
                torch.cuda.synchronize(device)
        if copied and not keep_on_card and not self.logged:  # an unload: every layer has its home now
            self.logged = True
            log.info("Overdrive quantization: the quantized layers have a home in page-locked host memory (%.2f GiB, "
                     "their own size): an unload copies them there without allocating, a load copies them in "
                     "asynchronously.", self.nbytes() / 2**30)
        return copied

    def _send_layer(self, layer, keep_on_card: bool, sources: set) -> int:
        slots = tensors_of(layer)
        if not slots or (not keep_on_card and all(t.device.type == "cpu" for *_, t in slots)):
            return 0
        home = self.homes.get(layer)
        if home is None or not home.fits(slots):
            home = self.homes[layer] = HomeOfLayer(layer)
        copied = 0
        for (sub, kind, name, tensor), view in zip(slots, home.views):
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor.detach(), non_blocking=True)
                copied += view.numel() * view.element_size()
                if tensor.device.type == "cuda":
                    sources.add(tensor.device)
            if not keep_on_card:
                put(sub, kind, name, view)
        return copied

    def bring(self, layers, device) -> None:
        """Each layer onto `device`: one asynchronous copy from its home where its slots hold it, else `.to`."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for layer in layers:
            home = self.homes.get(layer)
            slots = tensors_of(layer)
            if home is None or device.type != "cuda" or not home.fits(slots):
                layer.to(device)
                continue
            for (sub, kind, name, tensor), view in zip(slots, home.views):
                if tensor.device != device:
                    source = view if tensor.data_ptr() == view.data_ptr() else tensor
                    put(sub, kind, name, source.to(device, non_blocking=True))


def put(sub: torch.nn.Module, kind: str, name: str, tensor: torch.Tensor) -> None:
    """`tensor` into the slot (a parameter stays a parameter)."""
    if kind == "_parameters":
        tensor = torch.nn.Parameter(tensor, requires_grad=False)
    getattr(sub, kind)[name] = tensor


def register(block: torch.Tensor) -> bool:
    """Page-lock `block` where CUDA runs, as ComfyUI pins its weights (portable, within its pinned-memory limit; none
    with --disable-pinned-memory); False where it does not."""
    if not torch.cuda.is_available() or block.numel() == 0:
        return False
    import comfy.model_management as mm  # here: the rest of this module runs without ComfyUI (its tests do)
    if mm.MAX_PINNED_MEMORY <= 0:
        return False
    mm.ensure_pin_registerable(block.numel())  # ComfyUI gives back pins of its own first where its limit is near
    if torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 1) == 0:
        mm.TOTAL_PINNED_MEMORY += block.numel()  # counted where ComfyUI counts its own pins against that limit
        return True
    mm.discard_cuda_async_error()  # else a later kernel launch's check reports it as its own
    return False


def unregister(block: torch.Tensor) -> None:
    import comfy.model_management as mm
    torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
    mm.TOTAL_PINNED_MEMORY = max(0, mm.TOTAL_PINNED_MEMORY - block.numel())
