"""How a model call is split over processes: settings Parallel Model (ComfyUI) and parallelize_ (diffusers) share."""
from dataclasses import dataclass
from typing import Callable

# auto: the batch (CFG's passes) where it holds a part for every process, else each pass on its own group of processes
# that splits its tokens ("both"), else the tokens where the model allows it
MODES = ("auto", "cfg", "sequence", "both")
AUTO_ORDER = ("cfg", "both", "sequence")


@dataclass(frozen=True)
class ParallelConfig:
    """mode: "auto", "cfg" (the batch only: with classifier-free guidance batched, its passes), "sequence" (the image
    tokens only) or "both" (each pass on its own group of processes, which splits its tokens: 4 processes, 2 passes)."""
    mode: str = MODES[0]

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parallel mode {self.mode!r}; choose one of {', '.join(MODES)}")


def chosen(mode: str, why_not: Callable) -> tuple:
    """(the split `mode` takes for a call, None), or (None, every reason against, once each); `why_not(split)` says
    why a call cannot be split that way (None: it can). auto tries cfg, then both, then sequence."""
    reasons = []
    for split in AUTO_ORDER if mode == "auto" else (mode,):
        why = why_not(split)
        if why is None:
            return split, None
        reasons.append(why)
    return None, "; ".join(dict.fromkeys(reasons))


def why_not_groups(processes: int, parts: int, what: str) -> str | None:
    """Why `processes` do not split into a group of 2 or more for each of a call's `parts` (`what`: their name)."""
    if parts < 2 or processes % parts or processes == parts:
        return f"{processes} processes do not form a group of 2 or more for each of its {parts} {what}"
    return None
