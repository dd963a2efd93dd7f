"""How a model call is split over processes: settings Parallel Model (ComfyUI) and parallelize_ (diffusers) share."""
from dataclasses import dataclass

# auto: the batch (CFG's passes) where it holds a part for every process, else each pass on its own group of processes
# that splits its tokens ("both"), else the tokens where the model allows it
MODES = ("auto", "cfg", "sequence", "both")


@dataclass(frozen=True)
class ParallelConfig:
    """mode: "auto", "cfg" (the batch only: with classifier-free guidance batched, its passes), "sequence" (the image
    tokens only) or "both" (each pass on its own group of processes, which splits its tokens: 4 processes, 2 passes)."""
    mode: str = MODES[0]

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parallel mode {self.mode!r}; choose one of {', '.join(MODES)}")
