"""Precompiled frames: after a restart, run a saved compiled call without tracing the model again.

A restarted process traces the model's Python with Dynamo before Inductor's caches can serve a single kernel: for
SDXL that was most of a warm restart (bench/results/archive_2026-11-23_h100.md, run set 6). torch's AOT
precompile (`torch.compile(fn, fullgraph=True).aot_compile(inputs)`, torch >= 2.10) captures one whole-graph call
(the transformed bytecode and the compiled graph) into bytes that a new process loads and calls directly.

Dynamo's guards cannot be saved with it (they reference ComfyUI's nested op classes, which torch refuses to
serialise), so a frame is compiled without guards and Overdrive checks each call itself:
- `call_signature`: every tensor argument's shape, dtype, device and strides, and the value of every plain Python
  argument (numbers, strings, lists and dicts such as ComfyUI's transformer_options; ids by type only). A call
  carrying anything else (a function: an attention patch, a ControlNet object) is not precompiled and goes through
  torch.compile, guards and all;
- the architecture fingerprint and the options: frames live under the disk-cache entry keyed by them, the GPU and
  the versions; and the source files of the model's module classes (a ComfyUI update that changes the UNet's code
  builds new frames);
- every parameter and buffer on the input's device: a model that ComfyUI's low-VRAM mode left partly on the CPU
  goes through torch.compile.
- what the traced code read besides its arguments (compiler/traced_reads.py), recorded from Dynamo's own guards while
  the frame is built: the functions and classes reached from modules (a node that monkey-patches ComfyUI's attention
  function or torch's SDPA sends calls back to torch.compile), module-level values (flags, constants, default
  arguments), the model's attributes and the types of its submodules. Checked at every call, and against their saved
  printed forms after a restart.
That is what Dynamo's guards check, less two things (compiler/traced_reads.py); so a frame is safe to run by default
(`CompileOptions.precompile`).
"""
import contextlib
import dataclasses
import functools
import itertools
import hashlib
import inspect
import logging
import re
import time
import types
import uuid
import weakref

import torch

from ..core.errors import error_line
from ..core.interrupts import stops_held
from ..core.weights_watch import weights_generation
from ..core.storage import discard, read_framed, write_framed
from .traced_reads import GlobalsRead, ValuesRead, from_bytes, to_bytes

log = logging.getLogger("overdrive.compiler")


def supported() -> bool:
    return hasattr(torch._dynamo.config, "enable_aot_compile")


@functools.lru_cache(maxsize=None)
def _slot_names(cls: type) -> tuple:
    """The attributes of a class whose instances hold nothing but __slots__ (no __dict__); () for any other class.
    Cached per class: it is asked at every call for each value no other rule keys."""
    if cls.__module__ == "builtins" or "__dict__" in dir(cls) or not hasattr(cls, "__slots__"):
        return ()
    names = []
    for base in reversed(cls.__mro__[:-1]):  # object last: it has no slots
        slots = base.__dict__.get("__slots__", ())
        names.extend((slots,) if isinstance(slots, str) else slots)
    return tuple(names)


def _describe(value, parts: list, inert) -> bool:
    """Append what the compiled code may depend on in `value`; False if `value` holds something unkeyable."""
    if isinstance(value, torch.Tensor):
        parts.append(("T", tuple(value.shape), str(value.dtype), str(value.device), tuple(value.stride())))
    elif value is None or isinstance(value, (bool, int, float, str)):
        parts.append(("V", type(value).__name__, value))
    elif getattr(value, "precompile_key", None) is not None:
        # Overdrive's own objects that the forward calls and whose behaviour is their settings (the attention
        # override): keyed by those settings, which the traced code baked in.
        parts.append(("S", type(value).__qualname__))
        return _describe(value.precompile_key, parts, inert)
    elif isinstance(value, uuid.UUID) or getattr(value, "forward_inert", False) is True:
        # Ids (ComfyUI's per-cond uuids) and objects that declare the forward never calls them (Overdrive's own
        # device followers): read by patches only, and a patch is a function, which makes the call unkeyable.
        parts.append(("O", type(value).__qualname__))
    elif isinstance(value, (list, tuple)):
        parts.append((type(value).__name__, len(value)))
        return all(_describe(item, parts, inert) for item in value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Plain records of tensors (Flux's ModulationOut, which Chroma hands its blocks): keyed by class and fields,
        # as a tuple is; the frame reads the fields at every call.
        parts.append(("D", type(value).__module__, type(value).__qualname__))
        return all(_describe(getattr(value, field.name), parts, inert) for field in dataclasses.fields(value))
    elif isinstance(value, dict):
        parts.append(("dict", len(value)))
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                return False
            parts.append(("K", key))
            if key in inert:
                if inert[key] is None:
                    continue
                item = inert[key](item)
            if not _describe(item, parts, inert):
                return False
    elif _slot_names(type(value)):
        # Plain records with __slots__ (LTX-2's CompressedTimestep since ComfyUI 0.33): as a dataclass.
        parts.append(("R", type(value).__module__, type(value).__qualname__))
        return all(_describe(getattr(value, name, None), parts, inert) for name in _slot_names(type(value)))
    else:
        return False
    return True


def call_signature(method: str, args, kwargs, inert=types.MappingProxyType({})) -> tuple | None:
    """Everything about a call that a guard-free frame is specialised on, as a hashable tuple (looked up in memory
    at every call; hashed into a file name only when a frame is loaded or saved); None if not keyable. `inert`: entries of
    the front end's per-call options that no forward reads (CallOptions.inert)."""
    parts = [method, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    # A TorchFunctionMode around the call (attention routing: attention/routing.py) is traced into the frame; one
    # without a precompile_key (torch.device(...) as a context) makes the call unkeyable.
    modes = tuple(torch.overrides._get_current_function_mode_stack())
    if not _describe((args, kwargs, modes), parts, inert):
        return None
    return tuple(parts)


def code_digest(module: torch.nn.Module) -> str:
    """sha256 of the source files that define the classes of `module`'s tree (their contents, not where they are
    installed): the code a frame has baked in."""
    files = set()
    for path in {inspect.getsourcefile(type(m)) or type(m).__module__ for m in module.modules()}:
        try:
            with open(path, "rb") as f:
                files.add(hashlib.sha256(f.read()).hexdigest())
        except OSError:  # a class without a readable file (built in): its module name stands for it
            files.add(path)
    return hashlib.sha256("".join(sorted(files)).encode()).hexdigest()[:16]


def flatten_weight_subclasses(module: torch.nn.Module) -> int:
    """Flatten each weight of `module` that is a traceable tensor subclass (torch's __tensor_flatten__ protocol). Some
    set the attributes that hold their inner tensors only when flattened (comfy-kitchen's QuantizedTensor:
    `_param_scale`), and a frame reads those attributes directly: a weight made since tracing (moved to a device,
    switched to another checkpoint's) has them only once flattened. Returns how many were flattened."""
    flattened = 0
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
            tensor.__tensor_flatten__()
            flattened += 1
    return flattened


# module -> (weights generation, the dicts that hold its tensors). Not the module itself: a value holding its key would
# keep every model ever checked (each UNet a SwitchWeights replaced) alive.
_submodules = weakref.WeakKeyDictionary()


def weights_on(module: torch.nn.Module, device: torch.device) -> bool:
    """Every parameter and buffer of `module` on `device`: checked at every call, so kept cheap. The dicts that hold
    them are listed again only after a submodule or Parameter was replaced somewhere (weights_watch); the tensors are
    read from those dicts every time, since a device move swaps tensors and even Parameters in them without any hook.
    (The recursive `module.parameters()` costs far more per call, and a walk over every module's dicts more than
    this.)"""
    generation = weights_generation()
    cached = _submodules.get(module)
    if cached is None or cached[0] != generation:
        dicts = tuple(d for m in module.modules() for d in (m._parameters, m._buffers))
        cached = _submodules[module] = (generation, dicts)
    tensors = [t for d in cached[1] for t in d.values() if t is not None]
    if device.type == "cuda" and device.index is not None:  # get_device: the CUDA index, -1 anywhere else
        return all(i == device.index for i in set(map(torch.Tensor.get_device, tensors)))
    return all(t.device == device for t in tensors)


class GuardTemporaries:
    """The `tmp` names torch leaves in Dynamo's process-wide guard closure variables while a frame is built: `forget()`
    removes those added since this was made.

    With a guard_filter_fn, Dynamo reads the value of every guard (`make_guard_filter_entry`); a chained source binds
    its base object to a `tmp<N>` name in that shared dict and skips deleting it when the read raises (seen in torch
    2.11 to 2.14, `ChainedSource.get_value`). The guards are then built again with a copy of that dict, which their
    CheckFunctionManager keeps: a leaked name held an SDXL up block, and part of a dropped UNet stayed in VRAM for good
    (bench/results/archive_2026-11-23_h100.md, run sets 10 and 11). So the names go in the filter itself, before that
    copy."""

    def __init__(self):
        self.before = set(_guard_closure_vars())

    def forget(self):
        closure_vars = _guard_closure_vars()
        for name in [n for n in closure_vars if n not in self.before and _TEMPORARY.fullmatch(n)]:
            del closure_vars[name]


_TEMPORARY = re.compile(r"tmp\d*")


def _guard_closure_vars() -> dict:
    """Dynamo's shared guard closure variables ({} where this torch has none, or has not built them yet)."""
    closure_vars = getattr(torch._dynamo.guards, "_CLOSURE_VARS", None)
    return closure_vars if isinstance(closure_vars, dict) else {}


class PrecompiledFrames:
    """The precompiled calls of one shared graph: built with `aot_compile` at its first shape, saved, reloaded."""

    def __init__(self, fn, options):
        self.options = options
        # Inductor's settings of the mode (CUDA graphs...): given at compile, and set again while a saved frame is
        # loaded and run, since a loaded frame builds its CUDA-graph wrapper from the settings of that moment.
        self.inductor_settings = (torch._inductor.list_mode_options(options.inductor_mode())
                                  if options.backend == "inductor" else {})
        kwargs = {"fullgraph": True, "dynamic": False, "backend": options.backend,
                  "options": {"guard_filter_fn": self._drop_guards, **self.inductor_settings}}
        with self._config():  # torch 2.11 gives the wrapper its `aot_compile` only with this set when wrapping
            self.compiled = torch.compile(fn, **kwargs)
        self.f_globals = fn.__globals__
        self.frames: dict = {}  # signature -> (loaded or built frame, its GlobalsRead, its ValuesRead)
        self.guards_dropped: list = []  # Dynamo's guards of the frame being built
        self.temporaries: GuardTemporaries | None = None  # while a frame is being built
        self.stale: set = set()  # signatures whose frame's globals changed in this process (logged once)
        self.not_on_disk: set = set()  # signatures already looked for on disk in vain: no file check per call
        self.failure: str | None = None
        self.code: str | None = None  # code_digest of the model, taken at the first call

    def _path(self, directory, signature: tuple, module):
        if self.code is None:
            self.code = code_digest(module)
        return directory / f"{self.code}-{hashlib.sha256(repr(signature).encode()).hexdigest()[:24]}.bin"

    def _drop_guards(self, guard_entries):
        """No Dynamo guard is saved with a frame (torch cannot serialise ComfyUI's); they become its GlobalsRead and
        ValuesRead."""
        self.guards_dropped = list(guard_entries)
        if self.temporaries is not None:
            self.temporaries.forget()
        return [False] * len(guard_entries)

    def _config(self):
        return torch._dynamo.config.patch(enable_aot_compile=True)

    def settings(self):
        """Inductor's settings of this mode, for loading and running a saved frame. (Entered at every call: with none
        to set, as in the default mode, no config.patch, which builds a class each time.)"""
        if not self.inductor_settings:
            return contextlib.nullcontext()
        return torch._inductor.config.patch(self.inductor_settings)

    def load(self, signature: tuple, directory, call) -> object | None:
        """The frame for `signature` from memory or `directory`, if what it read when traced still reads the same for
        `call` (module, method, args, kwargs); None if there is none (or it is unreadable, or stale)."""
        if signature not in self.frames:
            if directory is None or signature in self.not_on_disk:
                return None
            if not self._load(signature, directory, call[0]):
                return None
        frame, code, values = self.frames[signature]
        return frame if self._still_current(signature, code, values, call) else None

    def _load(self, signature, directory, module) -> bool:
        path = self._path(directory, signature, module)
        if not path.is_file():
            self.not_on_disk.add(signature)
            return False
        start = time.perf_counter()
        try:
            (code, values), data = _split(read_framed(path))
            renamed = code.renamed()
            if renamed:  # e.g. a node now patches a function the frame had inlined: trace the code that runs now
                log.info("Overdrive: not using the precompiled frame %s, code it inlined changed since it was saved "
                         "(%s); compiling a new one.", path.name, renamed[0])
                self.not_on_disk.add(signature)
                return False
            from torch._dynamo.aot_compile import AOTCompiledFunction
            with self._config(), self.settings():
                frame = AOTCompiledFunction.deserialize(data, self.f_globals)
        except Exception as error:  # noqa: BLE001 - a bad frame costs a compile, never a generation
            log.warning("Overdrive: discarding the precompiled frame %s (%s); compiling instead.", path,
                        str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
            discard(path)
            self.not_on_disk.add(signature)
            return False
        log.info("Overdrive: loaded the precompiled frame %s in %.1f s (no tracing)", path.name,
                 time.perf_counter() - start)
        self.frames[signature] = (frame, code, values)
        return True

    def _still_current(self, signature, code, values, call) -> bool:
        """False (once with a warning) if a function, class or value the frame read was replaced or changed since it
        was traced: such calls go through torch.compile, whose guards see the change."""
        if code.unchanged() and values.matches(call):
            return True
        if signature not in self.stale:
            self.stale.add(signature)
            changed = code.changed() or values.changed(call) or ["(read differently)"]
            log.warning("Overdrive: %s changed after this model was precompiled (a node patching it?); its calls go "
                        "through torch.compile, which traces what runs now.", changed[0])
        return False

    def build(self, signature: tuple, directory, module, method, args, kwargs) -> object | None:
        """Compile this call ahead of time (one whole graph), keep it and save it under `directory`."""
        start = time.perf_counter()
        self.temporaries = GuardTemporaries()
        try:
            with self._config():
                frame = self.compiled.aot_compile(((module, method, args, kwargs), {}))
            with stops_held():  # compiled: a stop now lands once the frame is kept and saved, not thrown away
                code = GlobalsRead.from_guards(self.guards_dropped)
                values = ValuesRead.from_guards(self.guards_dropped, (module, method, args, kwargs))
                saved = self._save(frame, code, values, directory, signature, module)
                self.frames[signature] = (frame, code, values)
        except Exception as error:  # noqa: BLE001 - e.g. a graph break: torch.compile takes over
            self.failure = error_line(error)
            log.warning("Overdrive: precompiling %s failed (%s); compiling with torch.compile instead (a restart "
                        "traces the model again).", method, self.failure)
            return None
        finally:  # the guard entries hold the traced values, the model among them: kept, they kept its weights alive
            self.guards_dropped = []
            self.temporaries.forget()
            self.temporaries = None
        log.info("Overdrive: precompiled %s in %.1f s (%s)", method, time.perf_counter() - start, saved)
        return frame

    def _save(self, frame, code: GlobalsRead, values: ValuesRead, directory, signature: tuple, module) -> str:
        """Write a built frame under `directory`; says where, or why not."""
        if directory is None:
            return "not saved: the disk cache is off"
        try:
            path = self._path(directory, signature, module)
            write_framed(path, _join(code, values, type(frame).serialize(frame).serialized_data))
        except Exception as error:  # noqa: BLE001 - unsaved: the next restart compiles again
            return f"could not be saved ({error})"
        return f"saved to {path}: a restart loads it without tracing"


_FORMAT = b"OVFRAME3"  # then the length of what was read (8 bytes), what was read (traced_reads), the frame


def _join(code: GlobalsRead, values: ValuesRead, frame: bytes) -> bytes:
    header = to_bytes(code, values)
    return _FORMAT + len(header).to_bytes(8, "little") + header + frame


def _split(payload: bytes) -> tuple[tuple[GlobalsRead, ValuesRead], bytes]:
    if payload[:8] != _FORMAT:
        raise ValueError("a frame file of an older format")
    size = int.from_bytes(payload[8:16], "little")
    return from_bytes(payload[16:16 + size]), payload[16 + size:]
