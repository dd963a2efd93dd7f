"""The cached deep features of the last full step: one tensor per batch layout, dropped at every full step and reset.

A layout key names what a UNet call computes (batch size, ComfyUI's cond_or_uncond, a fingerprint of the
conditioning, ...; the UNet adapter builds it). When several calls of one step share a key (two area conds with the
same prompt, or a sampler evaluating one sigma twice), they are told apart by their order within the step.
"""
import torch


class FeatureCache:
    def __init__(self):
        self._entries: dict[tuple, torch.Tensor] = {}  # (layout key, occurrence) -> feature
        self._counts: dict = {}                         # layout key -> how many occurrences were recorded

    def clear(self) -> None:
        self._entries.clear()
        self._counts.clear()

    def put(self, key, occurrence: int, feature: torch.Tensor) -> None:
        self._entries[(key, occurrence)] = feature
        self._counts[key] = max(self._counts.get(key, 0), occurrence + 1)

    def get(self, key, occurrence: int) -> torch.Tensor | None:
        """The feature recorded for this layout at this occurrence; if the full step recorded this layout exactly
        once, that one serves every occurrence (it is unambiguous). None when there is none to reuse."""
        count = self._counts.get(key, 0)
        if count == 1:
            return self._entries.get((key, 0))
        return self._entries.get((key, occurrence))

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._entries.values())
