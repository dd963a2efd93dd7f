"""The callable that stands in for `module.<method>`: compiled path first, the eager path if that fails."""
import contextlib
import dataclasses
import logging

import torch

from ..core.cuda_streams import capturing, out_of_memory
from ..core.errors import error_line
from ..core.interrupts import raise_if_interrupt
from .fingerprint import architecture_fingerprint, describe
from .options import CompileOptions
from .regions import install_regions, uninstall_regions
from .shared_graph import eager_runs, shared_graph

log = logging.getLogger("overdrive.compiler")
OUT_OF_MEMORY_LIMIT = 3  # compiled calls out of memory in a row before an architecture runs eager for good


def mark_shape_generic(args, kwargs) -> None:
    """dynamic='auto' at a second shape: compile one graph generic in every dimension of the tensor arguments
    (batch, height, width, prompt length) instead of letting Dynamo generalise one dimension per recompile.
    PyTorch still specialises dimensions of size 1, so batch 1 and batch > 1 get one graph each. Plain lists and
    tuples are looked into, as shape_signature does: LTX-2's blocks take (video, audio)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            for dim in range(value.dim()):
                torch._dynamo.maybe_mark_dynamic(value, dim)
        elif type(value) in (list, tuple):
            mark_shape_generic(value, {})


def list_arguments(args, kwargs) -> list:
    """(list, its items) for each list argument: state a call may change in place (a video VAE's decoder takes the
    frames each causal conv cached in a list and replaces them), saved so that a compiled call that fails part-way is
    retried eager from the state it started with."""
    return [(value, list(value)) for value in (*args, *kwargs.values()) if isinstance(value, list)]


def _per_tensor(args, kwargs, describe) -> tuple:
    """`describe(tensor)` for each tensor argument, top-level or in plain lists and tuples (LTX-2's (video, audio)),
    None for any other argument."""
    def sig(value):
        if isinstance(value, torch.Tensor):
            return describe(value)
        if type(value) in (list, tuple):
            return tuple(sig(item) for item in value)
        return None
    return tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))


def _shape(tensor) -> tuple:
    return tuple(tensor.shape), str(tensor.dtype), str(tensor.device)


def _size_class(tensor) -> tuple:
    return tensor.dim(), tensor.dim() > 0 and tensor.shape[0] == 1, str(tensor.dtype), str(tensor.device)


def shape_signature(args, kwargs) -> tuple:
    """Shapes/dtypes/devices of the tensor arguments: what decides whether a new graph is needed."""
    return _per_tensor(args, kwargs, _shape)


def size_class(args, kwargs) -> tuple:
    """What even a shape-generic graph is specialised on: each tensor argument's rank, dtype, device and whether its
    batch (first) dimension is 1, which Dynamo specialises. Under dynamic='auto' each class gets one shape-generic
    graph, and later sizes of the class are that graph's (or eager), never a new graph."""
    return _per_tensor(args, kwargs, _size_class)


class CompiledMethod:
    """Runs `type(module).<method>` through the architecture's shared compiled graph.

    Any failure to compile or to run the compiled code falls back to the eager method, with a warning that
    says why; from then on this architecture runs eager (a generation never fails because of Overdrive).
    `reporter`, if given, is a context-manager factory `reporter(label)` entered while a compile may happen
    (ComfyUI's adapter shows it on the progress bar).
    """

    overdrive_stack = None  # set by stack.build when this is a diffusion model's forward

    def __init__(self, module: torch.nn.Module, method: str = "forward", options: CompileOptions | None = None,
                 reporter=None, variant: str = "", announce: bool = True):
        """`variant`: what the module tree will hold at run time that it does not hold now (e.g. layers a
        ModelPatcher swaps in when the model loads), so such a model gets its own graph entry. `announce`: log when
        the graph is shared (off for the blocks of one model, which share theirs by design)."""
        self.module = module
        self.announce = announce
        self.method = method
        self.reporter = reporter
        self.variant = variant
        # Inference only. Weight patches (LoRA) and switched weights arrive as requires_grad=False parameters; the
        # same flag on the originals keeps Dynamo's guards equal, so they never cause a recompile.
        module.requires_grad_(False)
        options = options or CompileOptions()
        self._use_options(options.for_module(module))
        if self.options != options:
            log.info("Overdrive: %s compiles one graph per resolution (dynamic=auto; its code is not shape-generic), "
                     "up to %d", describe(module), options.max_graphs)

    def _use_options(self, options: CompileOptions):
        """Pick the shared graph for these options. Regions are installed on the module in place: outside
        torch.compile a region is a plain call, so every other user of the module runs exactly as before."""
        self.options = options
        self.disk = options.disk_cache()  # the folder is read here, not at every step
        if options.regional:
            install_regions(self.module, self.options.call_options)
        else:
            uninstall_regions(self.module)
        extra = {"method": self.method, "options": options.as_key()}
        if self.variant:
            extra["variant"] = self.variant
        self.fingerprint = architecture_fingerprint(self.module, extra)
        self.graph, self.shared = shared_graph(self.fingerprint, self.method, options, describe(self.module))
        if self.shared and self.announce:
            log.info("Overdrive: %s.%s reuses the compiled graph of architecture %s (no recompile)",
                     describe(self.module), self.method, self.fingerprint)

    def _without_regions(self, *args, **kwargs):
        """Switch this module to the whole-graph entry of its architecture and run the call there."""
        self._use_options(dataclasses.replace(self.options, regional=False))
        return self(*args, **kwargs)

    def release_precompiled(self) -> None:
        """Free the precompiled frames held in memory when they can be loaded from disk again."""
        if self.disk is not None:
            self.graph.release_precompiled()

    def eager(self, *args, **kwargs):
        return getattr(type(self.module), self.method)(self.module, *args, **kwargs)

    def _may_compile(self, signature) -> bool:
        return signature not in self.graph.shapes_seen and signature not in self.graph.served_shapes

    def _later_size(self, args, kwargs) -> bool:
        """dynamic='auto': a new shape whose size class already has its shape-generic graph."""
        graph = self.graph
        return (self.options.dynamic == "auto" and graph.shapes_sealed
                and size_class(args, kwargs) in graph.generic_classes)

    def _after_later_size(self, signature, shapes, ran_eager: bool) -> None:
        """Remember whether the shape-generic graph served a later size. Where its guards refused it (Dynamo
        specialised a dimension that is 1 at this size: a tiny image's latent downsampled to 1 by 1 takes another
        path through GroupNorm's reshape, a single token is a dimension of 1), the size runs eager from now on: such a
        size is too small for a compile to pay."""
        if not ran_eager:
            self.graph.served_shapes.add(signature)
            return
        self.graph.eager_shapes.add(signature)
        log.info("Overdrive: %s runs shapes %s eager: its shape-generic graph does not cover this size (a dimension "
                 "of 1 there), and a size this small gets no graph of its own.", self.graph.description, shapes)

    def __call__(self, *args, **kwargs):
        graph = self.graph
        if graph.failure is not None:
            if self.options.regional:  # another module of this architecture found that regions fail here
                return self._without_regions(*args, **kwargs)
            return self.eager(*args, **kwargs)
        signature = shape_signature(args, kwargs)
        if signature in graph.eager_shapes:
            return self.eager(*args, **kwargs)
        new_shape = self._may_compile(signature)
        later_size = new_shape and self._later_size(args, kwargs)
        if new_shape and not later_size and len(graph.shapes_seen) >= self.options.max_graphs:
            log.warning("Overdrive: %s has already compiled %d shapes (max_graphs); running this new shape eager. "
                        "Use dynamic='auto' or 'dynamic' to serve many resolutions with one graph.",
                        graph.description, len(graph.shapes_seen))
            return self.eager(*args, **kwargs)
        generic = new_shape and self.options.dynamic == "auto" and graph.shapes_sealed
        if generic:
            mark_shape_generic(args, kwargs)
        compiling = new_shape and not later_size
        reporting = compiling and self.reporter is not None
        progress = self.reporter(f"compiling {graph.description}") if reporting else contextlib.nullcontext()
        saved = list_arguments(args, kwargs)
        runs = eager_runs()
        try:
            with progress:
                out = graph.call(self.module, args, kwargs, self.disk,
                                 known_shape=signature in graph.specialised_shapes, allow_new_graphs=not later_size)
        except Exception as error:  # noqa: BLE001 - any failure of the fast path must leave the eager path working
            for value, items in saved:
                value[:] = items
            return self._after_failure(error, args, kwargs)
        graph.out_of_memory_in_a_row = 0
        if later_size:
            self._after_later_size(signature, _per_tensor(args, kwargs, lambda t: tuple(t.shape)),
                                   ran_eager=eager_runs() != runs)
            return out
        if generic:
            graph.generic_classes.add(size_class(args, kwargs))
        graph.shapes_seen.add(signature)
        if not graph.shapes_sealed:
            graph.specialised_shapes.add(signature)
        if self.options.static_shapes == "first":
            graph.seal_shapes()
        return out

    def _after_failure(self, error: Exception, args, kwargs):
        """This call's result after its compiled code failed, and what the failure means for later calls: out of
        memory is the card's state at that moment (another model, a larger batch), so the compiled code is kept for
        the next call unless it runs out again OUT_OF_MEMORY_LIMIT times in a row; any other failure is the code's,
        and the architecture runs eager from then on."""
        graph = self.graph
        raise_if_interrupt(error)  # the user's stop: the prompt ends, the graph stays usable
        if capturing():
            raise error  # the recorder (block_graphs) runs this block without a graph
        reason = error_line(error, 500)
        if out_of_memory(error):
            graph.out_of_memory_in_a_row += 1
            if graph.out_of_memory_in_a_row < OUT_OF_MEMORY_LIMIT:
                torch.cuda.empty_cache()
                log.warning("Overdrive: the compiled %s.%s ran out of GPU memory; this call runs eager, the compiled "
                            "code stays for the next (%s)", graph.description, self.method, reason)
                return self.eager(*args, **kwargs)
        graph.failure = reason
        if self.options.regional:
            # Regions are newer compiler machinery than whole-graph compilation: try that before giving up.
            log.warning("Overdrive: compiling %s.%s with regions failed (%s); compiling it as one graph instead.",
                        graph.description, self.method, reason)
            return self._without_regions(*args, **kwargs)
        log.warning("Overdrive: the compiled %s.%s failed, so it runs eager from now on (your generation continues, "
                    "only slower). Reason: %s", graph.description, self.method, reason)
        return self.eager(*args, **kwargs)


def compile_module(module: torch.nn.Module, options: CompileOptions | None = None, method: str = "forward",
                   reporter=None) -> CompiledMethod:
    """Compile `module.<method>` in place (like `module.compile()`), sharing graphs across same-architecture modules."""
    compiled = CompiledMethod(module, method, options, reporter)
    setattr(module, method, compiled)
    return compiled


def uncompile_module(module: torch.nn.Module, method: str = "forward") -> None:
    """Undo `compile_module`: the module's own method runs again."""
    if isinstance(module.__dict__.get(method), CompiledMethod):
        delattr(module, method)
        uninstall_regions(module)
