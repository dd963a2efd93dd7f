"""One compiled entry point per architecture, shared by every module (checkpoint) of that architecture.

torch.compile caches compiled code on a function's code object, with guards on the inputs. We give each
architecture fingerprint its own copy of a tiny `call the module's method` function (a distinct code object)
and compile that: a second checkpoint of the same architecture passes its own module as an argument and
runs through the graphs already compiled (its parameters are graph inputs), with zero recompiles. If
anything really differs, Dynamo's guards catch it and recompile rather than run wrong code. With the `precompile`
option, calls that compiler/precompiled.py can key run a saved guard-free frame instead (its own checks replace the
guards there).
"""
import contextlib
import copy
import functools
import logging
import threading
import time
import types

import torch

from ..core.cuda_streams import capturing, out_of_memory
from ..core.errors import error_line
from ..core.interrupts import raise_if_interrupt, stop_in
from . import precompiled
from .activations import FastActivations
from .disk_cache import compile_key
from .remote_cache import configure_from_environment
from .options import CompileOptions

log = logging.getLogger("overdrive.compiler")


# By a name of this module's, not `torch.compiler.is_compiling`: a `torch` read by the traced function would root
# the guard sources of torch's own attributes (dtypes) at this module, which a precompiled frame cannot read back.
_is_compiling = torch.compiler.is_compiling


class _EagerRuns(threading.local):
    """How often this thread ran `_call_method` as Python rather than as compiled code: a call under a stance that
    refuses a new graph tells this way whether a compiled graph served it."""
    count = 0


_eager_runs = _EagerRuns()
_no_new_graphs = functools.partial(torch.compiler.set_stance, "eager_on_recompile")  # cached graphs or eager


def eager_runs() -> int:
    return _eager_runs.count


def _call_method(module, method, args, kwargs):
    if not _is_compiling():  # True while Dynamo traces this: compiled code never counts
        _eager_runs.count += 1
    # The class's method, not `module.<method>`: the instance attribute may be our own forwarder. `method` is its
    # name, or the function itself for a class Dynamo cannot look methods up on (see _method_argument).
    function = getattr(type(module), method) if isinstance(method, str) else method
    return function(module, *args, **kwargs)


def _call_method_fast_activations(module, method, args, kwargs):
    # The mode is entered inside the traced code, so it shapes the graph and costs nothing at run time.
    with FastActivations():
        return _call_method(module, method, args, kwargs)


@functools.lru_cache(maxsize=None)
def _allowed_in_graph(cls) -> bool:
    """Whether `cls` is registered with torch.compiler.allow_in_graph (diffusers' transformer blocks are): Dynamo
    then treats the class as one opaque op and cannot trace `cls.<method>`, so its calls would graph-break and run
    eager."""
    try:
        from torch._dynamo.trace_rules import is_callable_allowed
        return bool(is_callable_allowed(cls))
    except Exception:  # noqa: BLE001 - a torch without this helper: look methods up by name as before
        return False


def _method_argument(module, method: str):
    """The `method` argument of the traced function for `module`: the name, or the class's function itself."""
    return getattr(type(module), method) if _allowed_in_graph(type(module)) else method


def _fresh_function(name: str, template=_call_method):
    code = template.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, template.__globals__, name)


def attention_preference(options: CompileOptions):
    """The SDPA kernel order traced into the graph (the choice is made at trace time)."""
    if options.attention == "cudnn" and torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return sdpa_kernel(order, set_priority=True)
    return contextlib.nullcontext()


def dynamo_graph_count() -> int:
    """Graphs Dynamo has compiled in this process so far (all callers)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class SharedGraph:
    """The compiled callable for one architecture + method + options, with its bookkeeping."""

    def __init__(self, fingerprint: str, method: str, options: CompileOptions, description: str):
        configure_from_environment()  # OVERDRIVE_REDIS_URL, read before the first compile rather than at import
        self.fingerprint = fingerprint
        self.method = method
        self.options = options
        self.description = description
        self.lock = threading.RLock()
        self.graphs_compiled = 0  # new Dynamo graphs produced by calls through this entry point
        self.shapes_seen: set = set()
        self.shapes_sealed = False  # True once the specialised shapes are known (options.static_shapes)
        self.specialised_shapes: set = set()  # the shapes seen before sealing: they get precompiled frames
        self.generic_classes: set = set()  # size classes (compiled_method.size_class) with a shape-generic graph
        self.served_shapes: set = set()  # later sizes a shape-generic graph served, with no graph of their own
        self.eager_shapes: set = set()  # later sizes that graph does not cover, which run eager rather than compile
        self.failure: str | None = None  # set once compiling or running compiled code failed
        self.out_of_memory_in_a_row = 0  # compiled calls that ran out of memory since the last one that ran
        self.disk_keys_loaded: set = set()
        self.disk_keys: dict = {}  # device -> disk cache key
        kwargs = {"dynamic": options.torch_dynamic(), "fullgraph": options.fullgraph, "backend": options.backend}
        if options.backend == "inductor":
            kwargs["mode"] = options.inductor_mode()
        fn = _fresh_function(f"overdrive_{method}_{fingerprint}",
                             _call_method_fast_activations if options.fast_activations else _call_method)
        self.compiled = torch.compile(fn, **kwargs)
        self.frames = precompiled.PrecompiledFrames(fn, options) if (
            options.precompile and precompiled.supported()) else None

    def call(self, module, args, kwargs, disk=None, known_shape=False, allow_new_graphs=True):
        """`disk`: the caller's CompileDiskCache (its options' cache_dir), or None for memory only. `known_shape`: the
        call's tensor shapes are among the specialised ones (called before with other settings, e.g. another attention
        mode). `allow_new_graphs` False: a compiled graph whose guards accept the call runs it, else the eager method
        does (eager_runs() counts that), never a new graph."""
        key = self._disk_key(disk, args, kwargs)
        before = dynamo_graph_count()
        start = time.perf_counter()
        try:
            out, built = self._run(module, args, kwargs, disk, key, known_shape, allow_new_graphs)
        except BaseException as error:
            if disk is not None and stop_in(error) is not None:
                self._save_compiled(disk, key)  # what compiled before the stop: a restart does not lower it again
            raise
        if self.options.cuda_graphs:
            out = _own_copy(out)
        new_graphs = dynamo_graph_count() - before
        if new_graphs or built:
            self.graphs_compiled += new_graphs
            log.info(
                "Overdrive compiled %s.%s [%s]: %d graph(s) in %.1f s (mode=%s, cuda_graphs=%s, dynamic=%s)",
                self.description, self.method, self.fingerprint, new_graphs, time.perf_counter() - start,
                self.options.mode, self.options.cuda_graphs, self.options.dynamic,
            )
            if disk is not None:
                self._save_compiled(disk, key)
        return out

    def _disk_key(self, disk, args, kwargs) -> str | None:
        """The disk cache entry of this call's device, its artifacts loaded at its first call; None without a disk."""
        if disk is None:
            return None
        device = _first_device(args, kwargs)
        key = self.disk_keys.get(device)
        if key is None:  # hashing the GPU identity and versions is too slow for every step
            key = self.disk_keys[device] = compile_key(self.fingerprint, self.options.as_key(), device)
        if (disk.directory, key) not in self.disk_keys_loaded:
            disk.load(key)
            self.disk_keys_loaded.add((disk.directory, key))  # once loaded: a stop mid-load loads it again next call
        return key

    def _run(self, module, args, kwargs, disk, key, known_shape, allow_new_graphs) -> tuple:
        """(the call's output, whether a precompiled frame was built for it)."""
        method = _method_argument(module, self.method)
        with self._recompile_limit(), attention_preference(self.options):
            # Precompiled frames key the method by name: a class passed by function takes torch.compile's path.
            frame, built = (self._precompiled_frame(module, args, kwargs, disk, key, known_shape)
                            if method is self.method else (None, False))
            if self.options.cuda_graphs:
                _mark_step_begin()  # each call is a new inference step, not a continuation
            out = self._run_frame(frame, module, args, kwargs) if frame is not None else _NOT_RUN
            if out is _NOT_RUN:
                with contextlib.nullcontext() if allow_new_graphs else _no_new_graphs():
                    out = self.compiled(module, method, args, kwargs)
        return out, built

    @staticmethod
    def _save_compiled(disk, key) -> None:
        try:
            disk.save(key)
        except OSError as error:
            log.warning("Overdrive: could not write the compile cache to %s: %s", disk.directory, error)

    def seal_shapes(self) -> None:
        """The shapes compiled so far are the specialised ones (options.static_shapes); a new shape now follows the
        `dynamic` policy (one shape-generic graph under "auto") and gets no precompiled frame."""
        self.shapes_sealed = True

    def release_precompiled(self) -> None:
        """Forget the precompiled frames held in memory (with CUDA graphs, a frame's recording keeps the inputs of the
        model it last ran, a large share of a UNet's activations). Kept on disk, they load again in seconds."""
        if self.frames is not None:
            self.frames.frames.clear()
            self.frames.not_on_disk.clear()

    def _recompile_limit(self):
        # Entered at every UNet call: config.patch builds a class each time (measurable per call), so it is
        # skipped when the limit already is ours (Dynamo's default 8 equals max_graphs' default).
        if torch._dynamo.config.recompile_limit == self.options.max_graphs:
            return contextlib.nullcontext()
        return torch._dynamo.config.patch(recompile_limit=self.options.max_graphs)

    def _precompiled_frame(self, module, args, kwargs, disk, key, known_shape=False):
        """With `precompile`: (the saved or newly built guard-free frame for this call, whether it was built now),
        or (None, False) for torch.compile's path (no frame for a later shape, an argument that cannot be keyed,
        weights not all on the input's device; see compiler/precompiled.py). A specialised shape called with other
        settings (a second model of the architecture with 8-bit attention on) gets its own frame rather than
        torch.compile's guards at every call."""
        frames = self.frames
        if frames is None or frames.failure is not None:
            return None, False
        signature = precompiled.call_signature(self.method, args, kwargs, self.options.call_options.inert)
        if signature is None or not precompiled.weights_on(module, _first_device(args, kwargs)):
            return None, False
        # The folder only matters for a frame not in memory yet (a path built at every block call adds up).
        directory = disk.frames_dir(key) if disk is not None and signature not in frames.frames else None
        frame = frames.load(signature, directory, (module, self.method, args, kwargs))
        if frame is None and signature not in frames.frames and (known_shape or not self.shapes_sealed):
            # A new shape among the first ones (later: the `dynamic` policy). A frame that no longer applies (a value
            # it read changed) is not built again: such calls take torch.compile's path, guards and all.
            frame = frames.build(signature, directory, module, self.method, args, kwargs)
            return frame, frame is not None  # built: its kernels go to the disk cache with the frame
        return frame, False

    def _run_frame(self, frame, module, args, kwargs):
        for attempt in (1, 2):
            try:
                with self.frames.settings():
                    return frame(module, self.method, args, kwargs)
            except Exception as error:  # noqa: BLE001 - torch.compile's path (with guards) takes this call and the rest
                raise_if_interrupt(error)
                if capturing() or out_of_memory(error):
                    raise  # the recorder (block_graphs) runs it without a graph; the caller, eager for this call
                if attempt == 1 and isinstance(error, AttributeError) and precompiled.flatten_weight_subclasses(module):
                    continue  # weights made since tracing, whose inner tensors' attributes a flatten sets
                self.frames.failure = error_line(error)
                log.warning("Overdrive: the precompiled %s.%s failed (%s); compiling it with torch.compile instead.",
                            self.description, self.method, self.frames.failure)
                return _NOT_RUN


_NOT_RUN = object()


_step_begin = None


def _mark_step_begin():
    """torch.compiler.cudagraph_mark_step_begin without its `import` at every call (~75 us on a slow host CPU)."""
    global _step_begin
    if _step_begin is None:
        try:
            from torch._inductor.cudagraph_trees import mark_step_begin as _step_begin
        except ImportError:  # a torch that moved it: the public entry point does the same
            _step_begin = torch.compiler.cudagraph_mark_step_begin
    _step_begin()


def _own_copy(out):
    """CUDA-graph outputs live in memory the next replay overwrites; callers (samplers keeping the previous step's
    output) get their own copy. A latent or an image: negligible next to the step itself."""
    if isinstance(out, torch.Tensor) and out.is_cuda:
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_own_copy(o) for o in out)
    if isinstance(out, dict):  # e.g. diffusers' UNet2DConditionOutput / DecoderOutput (return_dict=True)
        copied = copy.copy(out)
        for key, value in out.items():
            copied[key] = _own_copy(value)
        return copied
    return out


def first_device(values) -> torch.device | None:
    """The device of the first tensor in `values`, looking into lists and tuples (LTX-2's model and blocks take
    [video, audio]); None when there is none."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (list, tuple)):
            device = first_device(value)
            if device is not None:
                return device
    return None


def _first_device(args, kwargs) -> torch.device:
    return first_device(list(args) + list(kwargs.values())) or torch.device("cpu")


_registry: dict[tuple, SharedGraph] = {}
_registry_lock = threading.Lock()


def shared_graph(fingerprint: str, method: str, options: CompileOptions, description: str) -> tuple[SharedGraph, bool]:
    """The SharedGraph for this key, creating it if needed. Returns (graph, was_already_there)."""
    key = (fingerprint, method)
    with _registry_lock:
        graph = _registry.get(key)
        if graph is not None:
            return graph, True
        graph = SharedGraph(fingerprint, method, options, description)
        _registry[key] = graph
        return graph, False


def clear_shared_graphs():
    """Forget every shared graph (tests; or to free the compiled code)."""
    with _registry_lock:
        _registry.clear()
