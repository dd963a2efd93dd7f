"""CUDA-graph replay of a DiT's compiled blocks: one launch per block call instead of the host's work for it.

Why: the host's work for a compiled block call (the precompiled frame's checks, Inductor's wrapper, the attention
op's launches) is about as long as a Flux.1 block's GPU work with fp8 GEMMs and 8-bit attention. A full step still
keeps the GPU busy, but the step cache's reused steps (one block of GPU work each) and diffusers' pipelines run at the
host's pace, in ComfyUI and more so in diffusers (bench/experiments/dit-block-cuda-graphs.md).

How a block call runs:
- The first call of a block with a call signature (argument shapes, dtypes and non-tensor values) runs the compiled
  block as it is: it compiles, and the attention choice times its backends.
- The second records a CUDA graph of it: once on copies of the inputs (a warm-up on the recording stream: lazy
  buffers and handles are made outside the recording), then recorded over static input buffers.
- Later calls copy each argument into its static buffer (skipped when it is that buffer, or was copied there earlier
  in this model call and no graph has written it since) and replay.

Buffers are chained: a block's hidden states are written back into its static input buffers (Flux's blocks do so
themselves, `img += ...`; for blocks that return new tensors the recording ends with that copy), so the next block,
recorded with those buffers as its inputs, reads them with no copy. Nothing a recording produces stays in its memory
pool after the replay, so every block of a model shares one pool: its size is one block's working memory.

A replay skips every check the compiled call makes, so it is keyed on what could change under it: the call
signature, the data pointers of the block's parameters and buffers (a LoRA patch or a device move makes new tensors:
the block records again; weights copied in place, as SwitchWeights does, are read by the replay), and whether a layer
applies weight functions at run time (ComfyUI's low-VRAM LoRA patches). Blocks with such functions, with weights
off the inputs' GPU or with weights copied in at each call (WEIGHTS_COPIED_IN) run without a graph. A recording that
fails (a block that synchronises with the host) leaves that signature without a graph, with a warning; the call itself
runs as before.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

import torch

from ..core.cuda_streams import give_back_cache_if_short, out_of_memory, replace_side_stream, side_stream
from ..core.interrupts import raise_if_interrupt

log = logging.getLogger("overdrive.compiler")

RECORD_AT_CALL = 2  # the first call compiles and chooses; the second records
# Failed recordings after which a model records no more: the rest of its blocks would most likely fail alike, each at
# the cost of a warm-up and a capture (out of memory stops it at the first).
FAILED_RECORDINGS_LIMIT = 2
# Set (True) on a block whose weights are copied in at each of its calls, by whatever streams them
# (comfy_host/quantized_streaming.py): their addresses are the allocator's of the moment, so it runs without a graph.
WEIGHTS_COPIED_IN = "overdrive_weights_copied_in"


def _flatten(value, tensors: list, objects: list):
    """A hashable description of `value` (the call's arguments), its tensors appended to `tensors` in order and its
    other objects (identity-compared) to `objects`, which the recording keeps alive so that their ids stay theirs."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_flatten(item, tensors, objects) for item in value))
    if isinstance(value, dict):
        return (dict, tuple((key, _flatten(item, tensors, objects)) for key, item in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return (type(value), value)
    objects.append(value)
    return (object, id(value))


# The BlockGraphs whose recordings hold NCCL collectives (a call's object said `records_collectives`: sequence
# parallelism's attention). A process must drop those recordings before it leaves its torch.distributed group, or
# leaving hangs (pytorch/pytorch#115388; bench/experiments/parallel-model.md).
_HOLDING_COLLECTIVES = weakref.WeakSet()


# The BlockGraphs that hold recordings, the latest last. Only the latest HOLDERS keep them: each holds a pool of one
# block's working memory that ComfyUI's memory planning does not see (the recordings of every LoRA's and setting's model,
# kept, ran a short card out of memory), while two models that take turns in one prompt (Wan 2.2 A14B's experts, a base
# and a refiner) keep theirs.
HOLDERS = 2
_HOLDING: list = []  # weak references


def _hold(graphs) -> None:
    """`graphs` starts holding recordings: the holders beyond the latest HOLDERS release theirs."""
    alive = [ref for ref in _HOLDING if ref() is not None and ref() is not graphs] + [weakref.ref(graphs)]
    for ref in alive[:-HOLDERS]:
        ref().release()
    _HOLDING[:] = alive[-HOLDERS:]


def release_collective_graphs() -> int:
    """Drop every recording that holds collectives (before destroy_process_group); how many models had some."""
    holding = list(_HOLDING_COLLECTIVES)
    for graphs in holding:
        graphs.release()
    _HOLDING_COLLECTIVES.clear()
    return len(holding)


def _rebuilt(value, tensors):
    """`value` with its tensors replaced, in order, from the iterator `tensors`."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuilt(item, tensors) for item in value)
    if isinstance(value, dict):
        return {key: _rebuilt(item, tensors) for key, item in value.items()}
    return value


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _BlockWeights:
    """The tensors a block's graph reads by address: every parameter and buffer of its module tree, looked up anew at
    each call (ModelPatcher replaces Parameter objects when it patches)."""

    def __init__(self, block: torch.nn.Module):
        self._block = block
        modules = list(block.modules())
        self._slots = [(m._parameters, name) for m in modules for name in m._parameters] + \
                      [(m._buffers, name) for m in modules for name in m._buffers]
        self._patched = [m for m in modules if hasattr(m, "weight_function")]

    def pointers(self) -> tuple:
        """The weights' addresses, and last whether a layer applies weight functions now (ComfyUI sets them on layers
        it keeps off the GPU; the lists change, the addresses may not)."""
        return (*(t.data_ptr() if t is not None else 0 for t in (slots[name] for slots, name in self._slots)),
                self._functions())

    def _functions(self) -> bool:
        return any(getattr(m, "weight_function", None) or getattr(m, "bias_function", None) for m in self._patched)

    def why_not(self, device: torch.device) -> str | None:
        """None when a graph can hold this block's weights by address, else why not."""
        if self._functions():
            return "its layers apply weight patches at run time (low-VRAM LoRA)"
        if getattr(self._block, WEIGHTS_COPIED_IN, False):
            return "its quantized layers are copied in from host memory at each call (the card has no room for them)"
        for slots, name in self._slots:
            tensor = slots[name]
            if tensor is not None and tensor.device != device:
                return f"its weights are on {tensor.device}, not {device}"
        return None


@dataclasses.dataclass
class _Recording:
    signature: tuple
    objects: list                 # the signature's identity-compared objects, kept alive
    weights: tuple                # the block's weight pointers when recorded
    graph: torch.cuda.CUDAGraph
    inputs: list                  # static input tensors, in the arguments' order
    written: list                 # the static inputs the graph writes (its outputs, and inputs it changes in place)
    output: object                # the block's output, made of static input tensors


class BlockGraphs:
    """The CUDA-graph recordings of one model's blocks, keyed by block path (one recording per block)."""

    def __init__(self):
        self._recordings: dict = {}   # path -> _Recording
        self._calls: dict = {}        # path -> (signature, weights, calls seen with them)
        self._refused: dict = {}      # path -> signature that could not be recorded
        self._weights: dict = {}      # path -> _BlockWeights
        self._filled: dict = {}       # id(static input) -> the argument copied into it in this model call
        self._pool = None
        self._warned: set = set()
        self._stopped = None  # why recording stopped for this model (a recording failed), until release()
        self._failed = 0      # recordings that failed, until release()
        self.replays = 0
        self.recorded = 0
        self.recorded_again = 0  # blocks recorded anew because their weights moved (ComfyUI reloaded the model)
        self._said_moved = False  # that, logged once per model call

    def forget_copies(self) -> None:
        """At the end of each model call: which arguments were copied into which buffers holds within one call.
        (Within it, an argument the model's own code changes in place between two block calls is not seen.)"""
        self._filled.clear()
        self._said_moved = False

    def release(self) -> None:
        """Drop every recording (and with the last one, the pool's memory)."""
        if self._recordings:
            torch.cuda.current_stream().synchronize()  # no replay still running over the buffers
        self._recordings.clear()
        self._calls.clear()
        self._filled.clear()
        self._weights.clear()  # the blocks' tensor slots: they hold the layers' tensors
        self._pool = None
        self._stopped = None
        self._failed = 0

    def describe(self) -> str:
        again = f", {self.recorded_again} recorded again after a reload" if self.recorded_again else ""
        return f"{len(self._recordings)} block CUDA graphs recorded ({self.replays} replays{again})"

    def call(self, path: str, block: torch.nn.Module, block_stack, run, args: tuple, kwargs: dict):
        """run(*args, **kwargs), the block's compiled call, through its recording when one applies."""
        if torch.is_grad_enabled():
            return run(*args, **kwargs)
        tensors, objects = [], []
        signature = (_flatten(args, tensors, objects), _flatten(kwargs, tensors, objects),
                     torch.is_inference_mode_enabled())
        if not tensors or not tensors[0].is_cuda or self._refused.get(path) == signature:
            return run(*args, **kwargs)
        weights = self._weights.get(path)
        if weights is None:
            weights = self._weights[path] = _BlockWeights(block)
        pointers = weights.pointers()
        recording, seen = self._recordings.get(path), self._calls.get(path)
        if recording is not None and recording.signature == signature:
            if recording.weights == pointers:
                return self._replay(recording, tensors)
            if seen is None or seen[1] != pointers:  # once per move, not at each call until recorded
                self._weights_moved(path)
        count = seen[2] + 1 if seen is not None and seen[0] == signature and seen[1] == pointers else 1
        self._calls[path] = (signature, pointers, count)
        if count < RECORD_AT_CALL:
            return run(*args, **kwargs)
        why = self._stopped or weights.why_not(tensors[0].device)
        if why is None:
            try:
                recording = self._record(block_stack, run, args, kwargs, tensors, signature, objects, pointers)
            except Exception as error:  # noqa: BLE001 - a block that cannot be recorded runs as before
                raise_if_interrupt(error)
                why = f"{type(error).__name__}: {str(error)[:200]}"
                self._failed += 1
                if out_of_memory(error) or self._failed >= FAILED_RECORDINGS_LIMIT:
                    # No more recordings for this model: each next block would fail the same way, and a graph would
                    # hold memory the model's calls need.
                    self._stopped = why
                    torch.cuda.empty_cache()
        if why is not None:
            self._refused[path] = signature
            if why not in self._warned:  # once per reason: a partly offloaded model would name every block
                self._warned.add(why)
                log.warning("Overdrive: block %s (and any other for the same reason) runs without a CUDA graph: %s",
                            path, why)
            return run(*args, **kwargs)
        self._recordings[path] = recording
        if any(getattr(o, "records_collectives", False) for o in objects):
            _HOLDING_COLLECTIVES.add(self)
        self.recorded += 1
        if self.recorded == 1:
            log.info("Overdrive: blocks replay as CUDA graphs from now on, each recorded at its second call with the "
                     "same shapes and weights (cuda_graphs=False turns this off)")
        return self._replay(recording, tensors)

    def _weights_moved(self, path: str) -> None:
        """A recorded block's weights are at other addresses now (a reload put them there): recorded again at its
        next call, which costs a plain call and a recording per block; said once per model call."""
        self.recorded_again += 1
        if not self._said_moved:
            self._said_moved = True
            log.info("Overdrive: block %s (and any other of this model call) is recorded again: its weights moved "
                     "since its CUDA graph was recorded (the model was reloaded)", path)

    # -- replay ----------------------------------------------------------------------------------------------------
    def _replay(self, recording: _Recording, tensors: list):
        filled = self._filled
        for source, static in zip(tensors, recording.inputs):
            if source is static or filled.get(id(static)) is source or _same_view(source, static):
                continue
            static.copy_(source)
            filled[id(static)] = source
        recording.graph.replay()
        for static in recording.written:
            filled.pop(id(static), None)
        self.replays += 1
        return recording.output

    # -- recording -------------------------------------------------------------------------------------------------
    def _static_inputs(self, tensors: list) -> list:
        """A static buffer per argument: one of this model's buffers when the argument is one (the previous block's
        output) or was copied into one earlier in this model call, else a new one, filled (outside the pool)."""
        known = list({id(s): s for r in self._recordings.values() for s in r.inputs}.values())
        statics = []
        for source in tensors:
            static = next((s for s in known if _same_view(source, s)
                           or (self._filled.get(id(s)) is source and s.shape == source.shape)), None)
            if static is None:
                # Contiguous, whatever the argument's layout: the block's output is written back here and read by the
                # next block. (Wan's first block gets its input transposed; a buffer in that layout made every later
                # block run the graph compiled for it, slower: bench/experiments/dit-block-cuda-graphs.md.)
                static = torch.empty(source.shape, dtype=source.dtype, device=source.device)
                static.copy_(source)
                self._filled[id(static)] = source
                known.append(static)
            statics.append(static)
        return statics

    def _record(self, block_stack, run, args, kwargs, tensors, signature, objects, pointers) -> _Recording:
        statics = self._static_inputs(tensors)
        tensors_in_order = iter(statics)  # args take theirs first, as _flatten listed them
        static_args, static_kwargs = _rebuilt(args, tensors_in_order), _rebuilt(kwargs, tensors_in_order)
        streams = block_stack.carried(static_args, static_kwargs)  # the hidden states, by name: where outputs go back
        current = torch.cuda.current_stream()
        if self._pool is None:  # also after release(): the model's graphs share one pool again
            _hold(self)
            self._pool = torch.cuda.graph_pool_handle()
        stream = side_stream(current.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            copies = iter([s.clone() for s in statics])  # the warm-up runs on copies: blocks change inputs in place
            in_use = torch.cuda.memory_allocated(current.device)
            run(*_rebuilt(args, copies), **_rebuilt(kwargs, copies))
            del copies
            # the warm-up's working memory, at most: the capture allocates as much again, in the pool
            give_back_cache_if_short(current.device, torch.cuda.max_memory_allocated(current.device) - in_use)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = block_stack.named(run(*static_args, **static_kwargs))
                for name, value in out.items():
                    target = streams.get(name)
                    if value is None or (target is not None and _same_view(value, target)):
                        continue  # written in place (Flux's blocks), or an output the compiled call re-viewed
                    if target is None or value.shape != target.shape or value.dtype != target.dtype:
                        raise ValueError(f"the block's output {name!r} has no input of its shape to go back to")
                    target.copy_(value)
            except BaseException:
                end_failed_capture(graph, current.device, self._pool)
                replace_side_stream(current.device)
                self._pool = None  # recordings made before keep theirs; the next one starts a new pool
                raise
            graph.capture_end()
            # Which other inputs the graph changes in place (inference tensors keep no version counter): replayed
            # once on the copies' values, compared.
            before = [s.clone() for s in statics]
            graph.replay()
            outputs = {id(streams[name]) for name, value in out.items() if value is not None}
            written = [s for s, b in zip(statics, before) if id(s) in outputs or not torch.equal(s, b)]
            for static, copy in zip(statics, before):  # the arguments' values, for the caller's replay
                static.copy_(copy)
        current.wait_stream(stream)
        output = block_stack.output({name: None if value is None else streams[name] for name, value in out.items()})
        return _Recording(signature, objects, pointers, graph, statics, written, output)


def end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool) -> None:
    """End a recording that failed and undo what torch's capture_end leaves undone when the capture was invalidated
    (it raises first; bench/probes/capture_failure_probe.py): the allocator's routing of the stream into `pool`, the failed
    capture's hold on that pool (what it allocated there stayed reserved: a short card then ran out of memory with
    gigabytes reserved and unused), and the default CUDA generator's capture mode (every later random draw on the GPU
    failed: "Offset increment outside graph capture"). The pool itself takes no capture again ("already recording to
    mempool_id"): the caller records later blocks into a new one."""
    try:
        graph.capture_end()
        return  # a valid capture that the block's own code failed after: the graph gives its pool back when dropped
    except Exception:  # noqa: BLE001 - its own error says less than the one that broke the recording
        pass
    index = device.index  # a stream's device: always indexed
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except Exception as error:  # noqa: BLE001 - capture_end got as far as its own clean-up, the pool's release too
        log.debug("Overdrive: after a failed capture: %s", error)
    else:  # capture_end stopped before its clean-up: the capture's hold on the pool is released here, once
        torch._C._cuda_releasePool(index, pool)
    generator = torch.cuda.default_generators[index]
    try:
        generator.graphsafe_set_state(generator.clone_state())  # a fresh state (not capturing), same seed and offset
    except Exception as error:  # noqa: BLE001 - the recording's own error is the one to report
        log.warning("Overdrive: after a failed CUDA-graph capture the GPU's random generator could not be reset "
                    "(%s: %s); random draws on the GPU may fail until a restart", type(error).__name__, error)
