"""How a model call is split over processes: the settings Parallel Model (ComfyUI) and parallelize_ (diffusers) share."""
from dataclasses import dataclass

# auto: the batch (CFG's passes) where it holds a part for every process, else the tokens where the model allows it
MODES = ("auto", "cfg", "sequence")


@dataclass(frozen=True)
class ParallelConfig:
    """mode: "auto", "cfg" (the batch only: with classifier-free guidance batched, its passes) or "sequence" (the
    image tokens only, Ulysses attention)."""
    mode: str = MODES[0]

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parallel mode {self.mode!r}; choose one of {', '.join(MODES)}")
