"""What the user can choose about compilation, validated once, in one place."""
from dataclasses import dataclass, asdict

MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
DYNAMIC = ("auto", "static", "dynamic")
ATTENTION = ("default", "cudnn")


@dataclass(frozen=True)
class CompileOptions:
    """Options for `compile_module`.

    mode:    Inductor's mode. "default" compiles fastest; "max-autotune-no-cudagraphs" benchmarks GEMM/conv
             kernels on this GPU at the first run (slower first image, faster after); "max-autotune" and
             "reduce-overhead" also capture CUDA graphs (best for small models bound by kernel launches).
    dynamic: shape policy. "auto": the first shape compiles static, a later new resolution or batch compiles
             one shape-generic graph that serves every later shape (at most 2 graphs per architecture);
             "static": one specialised graph per shape (fastest, recompiles for each new shape, bounded by
             `max_graphs`); "dynamic": one shape-generic graph from the start.
    """

    mode: str = "default"
    dynamic: str = "auto"
    backend: str = "inductor"
    fullgraph: bool = False
    max_graphs: int = 8
    attention: str = "default"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Unknown compile mode {self.mode!r}: choose one of {', '.join(MODES)}.")
        if self.dynamic not in DYNAMIC:
            raise ValueError(f"Unknown dynamic-shape policy {self.dynamic!r}: choose one of {', '.join(DYNAMIC)}.")
        if self.attention not in ATTENTION:
            raise ValueError(f"Unknown attention choice {self.attention!r}: choose one of {', '.join(ATTENTION)}.")
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1 (got {self.max_graphs}).")

    def torch_dynamic(self):
        """The value for torch.compile's `dynamic` argument."""
        return {"auto": None, "static": False, "dynamic": True}[self.dynamic]

    def as_key(self) -> dict:
        return asdict(self)
