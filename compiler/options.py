"""What the user can choose about compilation, validated once, in one place."""
from dataclasses import dataclass, field, fields, replace

from ..core.call_options import NO_CALL_OPTIONS, CallOptions
from ..families import family_of

MODES = ("default", "max-autotune")
DYNAMIC = ("auto", "static", "dynamic")
ATTENTION = ("default", "cudnn")
STATIC_SHAPES = ("first", "first_step")

@dataclass(frozen=True)
class CompileOptions:
    """Options for `compile_module`.

    mode:    "default" compiles fastest; "max-autotune" benchmarks GEMM/conv kernels on this GPU at the first run
             (slower first image, sometimes faster after).
    cuda_graphs: replay each step as one CUDA graph instead of launching thousands of kernels from Python: without
             it the GPU sat idle for much of a compiled SDXL step (bench/EXPERIMENTS.md). Costs a graph recording
             per new shape and keeps that shape's activation memory reserved.
    dynamic: shape policy. "auto": the first shape compiles static, a later new resolution or batch compiles
             one shape-generic graph that serves every later shape (at most 3 graphs per architecture:
             PyTorch specialises size-1 dims, so batch 1 and batch > 1 each get a generic graph; a later size that
             graph's guards refuse, where a dimension is 1 inside the model as in a tiny image, runs eager instead);
             "static": one specialised graph per shape (fastest, recompiles for each new shape, bounded by
             `max_graphs`); "dynamic": one shape-generic graph from the start.
    regional: compile each distinct repeated transformer block once and call it for every block of that shape
             (torch.compiler.nested_compile_region) instead of compiling all of them inline: SDXL's 70 blocks
             become 2 subgraphs, so Inductor's share of a cold compile shrinks several-fold (compiler/regions.py).
             Still one graph, and one CUDA graph per step.
    precompile: save the first shape's compiled call whole (torch's AOT precompile) so that a restart loads it
             without tracing the model again (SDXL: most of a warm restart, which Inductor's caches cannot save).
             The saved call has no Dynamo guards; Overdrive checks each call's shapes, argument values and weight
             devices, and what the traced code read (functions, module-level values, the model's attributes,
             submodule types), recorded from Dynamo's guards (compiler/precompiled.py). A call it cannot
             check goes through torch.compile.
    static_shapes: which call shapes compile specialised (and, with `precompile`, get a saved frame) before
             `dynamic` applies: "first" (a whole model: its first resolution) or "first_step" (a DiT's blocks: every
             shape its first sampling step uses, since one block graph serves several token layouts in a step, such
             as Z-Image's refiners and main layers; the caller says when that step is over with
             `SharedGraph.seal_shapes`).
    fast_activations: trace tanh-GELU as the same function through a sigmoid (compiler/activations.py), which
             Inductor compiles into a faster kernel; on for DiT blocks (core/blockwise.py), whose MLPs use it.
    cache_dir: the folder of compiled artifacts on disk (ComfyUI's nodes: beside its models); None:
             $OVERDRIVE_CACHE_DIR/compiled, else ~/.cache/overdrive/compiled. OVERDRIVE_DISK_CACHE=0 keeps them in
             memory only. Not part of any key: the same graph serves every folder.
    """

    mode: str = "default"
    cuda_graphs: bool = True
    dynamic: str = "auto"
    backend: str = "inductor"
    fullgraph: bool = False
    max_graphs: int = 8
    attention: str = "default"
    regional: bool = True
    precompile: bool = True
    static_shapes: str = "first"
    fast_activations: bool = False
    cache_dir: str | None = field(default=None, compare=False)
    call_options: CallOptions = field(default=NO_CALL_OPTIONS, compare=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Unknown compile mode {self.mode!r}: choose one of {', '.join(MODES)}.")
        if self.dynamic not in DYNAMIC:
            raise ValueError(f"Unknown dynamic-shape policy {self.dynamic!r}: choose one of {', '.join(DYNAMIC)}.")
        if self.attention not in ATTENTION:
            raise ValueError(f"Unknown attention choice {self.attention!r}: choose one of {', '.join(ATTENTION)}.")
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1 (got {self.max_graphs}).")
        if self.static_shapes not in STATIC_SHAPES:
            raise ValueError(f"Unknown static_shapes {self.static_shapes!r}: choose one of {', '.join(STATIC_SHAPES)}.")

    def inductor_mode(self) -> str:
        """Inductor's mode name for this mode + CUDA-graph choice."""
        return {("default", False): "default", ("default", True): "reduce-overhead",
                ("max-autotune", False): "max-autotune-no-cudagraphs", ("max-autotune", True): "max-autotune"}[
            (self.mode, self.cuda_graphs)]

    def torch_dynamic(self):
        """The value for torch.compile's `dynamic` argument."""
        return {"auto": None, "static": False, "dynamic": True}[self.dynamic]

    def for_module(self, module) -> "CompileOptions":
        """The options `module` compiles with: "auto" means one graph per shape for the classes above."""
        if self.dynamic == "auto" and getattr(family_of(module), "static_under_auto", False):
            return replace(self, dynamic="static")
        return self

    def as_key(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cache_dir", "call_options")}

    def __getstate__(self):  # the host's call options stay in its process: a host in another gives its own
        return {k: v for k, v in self.__dict__.items() if k != "call_options"}

    def __setstate__(self, state):
        self.__dict__.update(state, call_options=NO_CALL_OPTIONS)

    def disk_cache(self):
        from .disk_cache import disk_cache_for
        return disk_cache_for(self.cache_dir)
