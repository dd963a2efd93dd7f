"""Quantize Model's layers on a card too small for all of them: the layers that do not fit stay in pinned host memory
and are copied in as their block runs, the next block's copy overlapping this one's compute on a side stream (ComfyUI
streams float layers so under a budget; the quantized layers are Overdrive's to place). Blocks are the items of the
model's ModuleLists (Flux's double and single blocks, Wan's blocks, a UNet's input/output blocks); a layer outside
every ModuleList always stays on the GPU."""
import logging

import torch

from ..compiler.block_graphs import WEIGHTS_COPIED_IN
from ..quantization.low_rank import base_of
from .gpu_budget import room_for_weights
from .layer_tensors import tensor_bytes, tensors_of
from .pinned_home import PinnedHome

log = logging.getLogger("overdrive")


def float_bytes_to_load(tree: torch.nn.Module, layers: dict, device) -> int:
    """Bytes of `tree`'s tensors outside `layers` ({name: quantized layer}) that are not on `device` yet: what ComfyUI's
    loader brings onto the card after the quantized layers are placed (norms, embeddings, a block's own tensors)."""
    device, total = torch.device(device), 0
    for name, sub in tree.named_modules():
        inside = name
        while inside and inside not in layers:
            inside = inside.rpartition(".")[0]
        if inside:
            continue
        for kind in ("_parameters", "_buffers"):
            total += sum(t.numel() * t.element_size() for t in getattr(sub, kind).values()
                         if t is not None and t.device != device)
    return total


def block_of(tree: torch.nn.Module, name: str) -> str | None:
    """The name of the outermost ModuleList item that holds layer `name` ("double_blocks.3" for
    "double_blocks.3.img_mlp.0"); None outside every ModuleList."""
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        parent = ".".join(parts[:end - 1])
        if isinstance(tree.get_submodule(parent) if parent else tree, torch.nn.ModuleList):
            return ".".join(parts[:end])
    return None


def split_by_room(tree: torch.nn.Module, layers: dict, room: int | None, sizes: dict | None = None) -> tuple:
    """(resident {name: layer}, streamed {block name: {name: layer}}): layers in model order stay resident while they
    fit `room` bytes (None: all of them); a block's layers after that are streamed. `sizes`: {name: bytes}, where the
    caller has them."""
    if room is None:
        return dict(layers), {}
    resident, streamed, used = {}, {}, 0
    for name, layer in layers.items():
        block, size = block_of(tree, name), sizes[name] if sizes is not None else tensor_bytes(layer)
        if block is None or (used + size <= room and not streamed):
            resident[name] = layer
            used += size
        else:
            streamed.setdefault(block, {})[name] = layer
    return resident, streamed


class SideStreamCopies:
    """Host-to-GPU copies on a side CUDA stream, so that the next block's layers arrive while the current block
    computes: `send(tensors)` starts them and returns a ticket, `receive(ticket)` makes the compute stream wait for them
    and hands the GPU tensors over (the allocator then keeps their memory until the compute stream is done with
    them)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)

    def send(self, tensors: list):
        with torch.cuda.stream(self.side):
            copies = [tensor.to(self.device, non_blocking=True) for tensor in tensors]
            done = torch.cuda.Event()
            done.record(self.side)
        return copies, done

    def receive(self, ticket) -> list:
        copies, done = ticket
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for tensor in copies:
            tensor.record_stream(compute)
        return copies


class InlineCopies:
    """The same interface copying at once on the current stream (the CPU, and tests of the order logic)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def send(self, tensors: list):
        return [tensor.to(self.device, non_blocking=True) for tensor in tensors]

    def receive(self, ticket) -> list:
        return ticket


class StreamedBlocks:
    """Hooks on the blocks whose quantized layers live in pinned host memory: as a block starts, its layers' tensors
    go in (copied ahead, see below), and the next streamed block's copy starts on a side stream, so that it overlaps
    this block's compute (the last block fetches the first for the next model call); after the block, the GPU copies
    return to PyTorch's cache. Room for one block more is the price (`place` keeps it). A block that runs out of the
    expected order copies its own at once and the copy made ahead is dropped.
    While the model is loaded, a streamed layer's buffers are empty (None) outside its block's call: ComfyUI's
    dynamic-VRAM loader moves every buffer it finds onto the GPU, which would load them all after all (and run a
    short card out of memory). `stop` puts the host tensors back, so that between runs the layers are whole (Switch
    Weights re-quantizes them, a copy of the model copies them). Inert while another clone's layers sit in the block (a
    float clone shares the module tree)."""

    def __init__(self, copies=None, home: PinnedHome | None = None):
        self.home = home if home is not None else PinnedHome()  # the layers' page-locked host copies
        self.pinned = {}  # id(layer) -> [(submodule, buffer name, its page-locked host tensor)]
        self.handles = []
        self.emptied = []  # host copies [(submodule, buffer name, tensor)] whose buffers are None until `stop`
        self.copies = copies  # how tensors travel (None: chosen by the device at `start`)
        self.blocks = []  # [(first layer's name in the block, first layer, host copies)], in model order
        self.ahead = None  # (block index, ticket) of the copy started ahead
        self.marked = []  # the blocks marked WEIGHTS_COPIED_IN
        self.warned = False  # a copy ahead ran out of memory

    def host_copies(self, layer) -> list:
        if id(layer) not in self.pinned:  # page-locked: copied without staging, and asynchronously
            self.pinned[id(layer)] = [(sub, name, view) for sub, kind, name, view in self.home.views(layer)
                                      if kind == "_buffers"]
        return self.pinned[id(layer)]

    def start(self, tree: torch.nn.Module, streamed: dict, device) -> None:
        self.stop()
        device = torch.device(device)
        if self.copies is None or self.copies.device != device:
            self.copies = SideStreamCopies(device) if device.type == "cuda" else InlineCopies(device)
        for index, (block_name, layers) in enumerate(streamed.items()):
            block = tree.get_submodule(block_name)
            first_name, first_layer = next(iter(layers.items()))
            host = [copy for layer in layers.values() for copy in self.host_copies(layer)]
            empty(host)
            self.emptied.extend(host)
            self.blocks.append((first_name[len(block_name) + 1:], first_layer, host))
            self.handles.append(block.register_forward_pre_hook(self._bring_in(index)))
            self.handles.append(block.register_forward_hook(lambda block, args, output, host=host: empty(host)))
            block.__dict__[WEIGHTS_COPIED_IN] = True  # no CUDA graph of it (compiler/block_graphs.py)
            self.marked.append(block)

    def in_flight_bytes(self) -> int:
        """At most what the streamed copies hold on the card at once: the running block's and the one copied ahead
        (the two largest, to be safe)."""
        sizes = sorted(sum(tensor.numel() * tensor.element_size() for *_, tensor in host) for *_, host in self.blocks)
        return sum(sizes[-2:])

    def _bring_in(self, index: int):
        def hook(block, args):
            first_name, first_layer, host = self.blocks[index]
            if base_of(block.get_submodule(first_name)) is not first_layer:  # a side path runs the layer too
                return
            ahead, self.ahead = self.ahead, None
            ticket = ahead[1] if ahead is not None and ahead[0] == index else self._send_now(host)
            for (sub, name, _), tensor in zip(host, self.copies.receive(ticket)):
                sub._buffers[name] = tensor
            following = (index + 1) % len(self.blocks)
            try:
                self.ahead = (following, self.copies.send([tensor for *_, tensor in self.blocks[following][2]]))
            except torch.OutOfMemoryError as error:  # the next block copies its own when it starts
                if not self.warned:
                    self.warned = True
                    log.warning("Overdrive quantization: no room to copy the next block's layers ahead (%s); each "
                                "streamed block copies its own as it starts.", str(error).splitlines()[0][:160])
        return hook

    def _send_now(self, host):
        try:
            return self.copies.send([tensor for *_, tensor in host])
        except torch.OutOfMemoryError:  # memory PyTorch caches in pieces too small: given back, tried once more
            torch.cuda.empty_cache()
            return self.copies.send([tensor for *_, tensor in host])

    def stop(self) -> None:
        for handle in self.handles:
            handle.remove()
        for sub, name, tensor in self.emptied:
            sub._buffers[name] = tensor
        for block in self.marked:
            block.__dict__.pop(WEIGHTS_COPIED_IN, None)
        self.handles, self.emptied, self.blocks, self.ahead, self.marked = [], [], [], None, []

    def forget(self, layers) -> None:
        """Drop the host copies of `layers` (they are resident again, or gone)."""
        for layer in layers:
            self.pinned.pop(id(layer), None)


def empty(host) -> None:
    for sub, name, _ in host:
        sub._buffers[name] = None


def place(tree: torch.nn.Module, layers: dict, device, streaming: StreamedBlocks, move, free_cache=None,
          activations: int = 0, streaming_workspace: int = 0) -> int:
    """Put `layers` ({name: quantized layer}) on `device` as far as the card's budget allows beside one model call's
    `activations` (bytes) and the model's float tensors still to load, and stream the rest (`move(modules, device)`
    moves); returns the bytes streamed per model call. `free_cache(bytes)`, if given, first frees up to that much of
    what ComfyUI keeps cached on the card (returns what it freed). `streaming_workspace`: more room kept free where
    some layers stream anyway (a compiled model's working memory beside the copies; where all fit, the model's own
    fit check has counted it)."""
    streaming.stop()  # every layer whole again before it is measured and placed
    sizes = {name: tensor_bytes(layer) for name, layer in layers.items()}  # read once: the streamed ones empty below
    resident, streamed = split_for_card(tree, layers, sizes, device, activations, free_cache)
    if streamed and streaming_workspace:
        resident, streamed = split_for_card(tree, layers, sizes, device, activations + streaming_workspace)
    streaming.forget(resident.values())
    move(resident.values(), device)
    if streamed:
        streaming.start(tree, streamed, device)
    return sum(sizes[name] for block in streamed.values() for name in block)


def split_for_card(tree: torch.nn.Module, layers: dict, sizes: dict, device, activations: int, free_cache=None):
    """split_by_room with the room the card has for `layers` beside `activations` bytes (see place), less one streamed
    block: its copy made ahead sits beside the running one."""
    room = room_for_weights(device, activations)
    if room is not None:  # the layers already there are part of what may stay
        to_load = float_bytes_to_load(tree, layers, device)
        room -= to_load
        on_card = sum(sizes[name] for name, layer in layers.items()
                      if any(tensor.device == torch.device(device) for *_, tensor in tensors_of(layer)))
        wanted = sum(sizes.values()) - on_card
        if free_cache is not None and wanted > room and free_cache(wanted - room):
            room = room_for_weights(device, activations) - to_load
        room += on_card
    resident, streamed = split_by_room(tree, layers, room, sizes)
    if streamed:
        largest = max(sum(sizes[name] for name in block) for block in streamed.values())
        resident, streamed = split_by_room(tree, layers, room - largest, sizes)
    return resident, streamed
