"""Precompiled frames (opt-in): after a restart, run a saved compiled call without tracing the model again.

A restarted process traces the model's Python with Dynamo before Inductor's caches can serve a single kernel: for
SDXL on the H100 that was 20.8 s of the 34 s a warm restart took (bench/README.md, sixth session). torch's AOT
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
What no check sees is code changed at run time that keeps the architecture and the files (a custom node that
monkey-patches a forward or ComfyUI's attention function): hence opt-in, `CompileOptions(precompile=True)`.
"""
import hashlib
import inspect
import itertools
import logging
import time
import uuid

import torch

from .disk_cache import read_checked, write_atomic

log = logging.getLogger("overdrive.compiler")


def supported() -> bool:
    return hasattr(torch._dynamo.config, "enable_aot_compile")


def _describe(value, parts: list) -> bool:
    """Append what the compiled code may depend on in `value`; False if `value` holds something unkeyable."""
    if isinstance(value, torch.Tensor):
        parts.append(("T", tuple(value.shape), str(value.dtype), str(value.device), tuple(value.stride())))
    elif value is None or isinstance(value, (bool, int, float, str)):
        parts.append(("V", type(value).__name__, value))
    elif isinstance(value, uuid.UUID) or getattr(value, "forward_inert", False) is True:
        # Ids (ComfyUI's per-cond uuids) and objects that declare the forward never calls them (Overdrive's own
        # device followers): read by patches only, and a patch is a function, which makes the call unkeyable.
        parts.append(("O", type(value).__qualname__))
    elif isinstance(value, (list, tuple)):
        parts.append((type(value).__name__, len(value)))
        return all(_describe(item, parts) for item in value)
    elif isinstance(value, dict):
        parts.append(("dict", len(value)))
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                return False
            parts.append(("K", key))
            if not _describe(item, parts):
                return False
    else:
        return False
    return True


def call_signature(method: str, args, kwargs) -> tuple | None:
    """Everything about a call that a guard-free frame is specialised on, as a hashable tuple (looked up in memory
    at every call; hashed into a file name only when a frame is loaded or saved); None if not keyable."""
    parts = [method, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    if not _describe((args, kwargs), parts):
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


def weights_on(module: torch.nn.Module, device: torch.device) -> bool:
    return all(t.device == device for t in itertools.chain(module.parameters(), module.buffers()))


class PrecompiledFrames:
    """The precompiled calls of one shared graph: built with `aot_compile` at its first shape, saved, reloaded."""

    def __init__(self, fn, options):
        self.options = options
        # Inductor's settings of the mode (CUDA graphs...): given at compile, and set again while a saved frame is
        # loaded and run, since a loaded frame builds its CUDA-graph wrapper from the settings of that moment.
        self.inductor_settings = (torch._inductor.list_mode_options(options.inductor_mode())
                                  if options.backend == "inductor" else {})
        kwargs = {"fullgraph": True, "dynamic": False, "backend": options.backend,
                  "options": {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, **self.inductor_settings}}
        with self._config():  # torch 2.11 gives the wrapper its `aot_compile` only with this set when wrapping
            self.compiled = torch.compile(fn, **kwargs)
        self.f_globals = fn.__globals__
        self.frames: dict = {}  # signature -> loaded or built frame
        self.not_on_disk: set = set()  # signatures already looked for on disk in vain: no file check per call
        self.failure: str | None = None
        self.code: str | None = None  # code_digest of the model, taken at the first call

    def _path(self, directory, signature: tuple, module):
        if self.code is None:
            self.code = code_digest(module)
        return directory / f"{self.code}-{hashlib.sha256(repr(signature).encode()).hexdigest()[:24]}.bin"

    def _config(self):
        return torch._dynamo.config.patch(enable_aot_compile=True)

    def settings(self):
        """Inductor's settings of this mode, for loading and running a saved frame."""
        return torch._inductor.config.patch(self.inductor_settings)

    def load(self, signature: tuple, directory, module) -> object | None:
        """The frame for `signature` from memory or `directory`; None if there is none (or it is unreadable)."""
        frame = self.frames.get(signature)
        if frame is not None or directory is None or signature in self.not_on_disk:
            return frame
        path = self._path(directory, signature, module)
        if not path.is_file():
            self.not_on_disk.add(signature)
            return None
        start = time.perf_counter()
        try:
            payload = read_checked(path)
            from torch._dynamo.aot_compile import AOTCompiledFunction
            with self._config(), self.settings():
                frame = AOTCompiledFunction.deserialize(payload, self.f_globals)
        except Exception as error:  # noqa: BLE001 - a bad frame costs a compile, never a generation
            log.warning("Overdrive: discarding the precompiled frame %s (%s); compiling instead.", path,
                        str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
            path.unlink(missing_ok=True)
            self.not_on_disk.add(signature)
            return None
        log.info("Overdrive: loaded the precompiled frame %s in %.1f s (no tracing)", path.name,
                 time.perf_counter() - start)
        self.frames[signature] = frame
        return frame

    def build(self, signature: tuple, directory, module, method, args, kwargs) -> object | None:
        """Compile this call ahead of time (one whole graph), keep it and save it under `directory`."""
        start = time.perf_counter()
        try:
            with self._config():
                frame = self.compiled.aot_compile(((module, method, args, kwargs), {}))
        except Exception as error:  # noqa: BLE001 - e.g. a graph break: torch.compile takes over
            self.failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            log.warning("Overdrive: precompiling %s failed (%s); compiling with torch.compile instead (a restart "
                        "traces the model again).", method, self.failure)
            return None
        self.frames[signature] = frame
        saved = "not saved: the disk cache is off"
        if directory is not None:
            try:
                path = self._path(directory, signature, module)
                write_atomic(path, type(frame).serialize(frame).serialized_data)
                saved = f"saved to {path}: a restart loads it without tracing"
            except Exception as error:  # noqa: BLE001 - unsaved: the next restart compiles again
                saved = f"could not be saved ({error})"
        log.info("Overdrive: precompiled %s in %.1f s (%s)", method, time.perf_counter() - start, saved)
        return frame
