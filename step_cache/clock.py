"""The sampler's progress as the host knows it: which step a model call belongs to, without reading the GPU.

Reading a call's sigma from the GPU makes the host wait until the GPU has run everything queued before it, and the
GPU then waits for all the host does next (Overdrive's checks, the CUDA-graph launch). A shallow step is so short on
the GPU that this host time becomes the step's time (SDXL: bench/experiments/deepcache-host-time-step-clock.md). A sampler
that reports each step as it finishes (ComfyUI's callback) lets the runner take the step's sigma from the run's
schedule, read from the GPU once per run, while the GPU is still busy with earlier steps.
"""
from collections import deque

import torch

from .schedule import DeferredFloats, host_floats

STEP_CLOCK = "overdrive_step_clock"  # where a caller puts its StepClock in transformer_options


class StepClock:
    """One sampling run: `schedule`, its sigmas (ComfyUI's `sigmas`, ending with the last one), and `step`, the steps
    finished so far, i.e. the index of the step whose calls the model is evaluating now. The caller creates one per run
    and calls `finished(i)` as step i ends; a sampler whose calls do not evaluate sigmas[i] at step i must not get one
    (StepClockCheck catches those that do)."""

    # It rides in transformer_options, which compiled forwards receive; they never call it, so a precompiled frame is
    # keyed by its type only (compiler/precompiled.py), not made unkeyable by it.
    forward_inert = True

    def __init__(self, schedule: torch.Tensor):
        self.schedule = schedule
        self.step = 0
        self._values = None

    def finished(self, index: int) -> None:
        self.step = index + 1

    def values(self) -> list[float]:
        """The schedule's sigmas as floats: read from the GPU at the first call of the run, once."""
        if self._values is None:
            self._values = host_floats([self.schedule])[0]
        return self._values

    def sigma(self) -> float | None:
        """The sigma of the current step (None past the schedule's end)."""
        values = self.values()
        return values[self.step] if self.step < len(values) else None


class StepClockCheck:
    """The sigmas a clock gave, checked against each call's own sigmas once the GPU has copied them, never waiting for
    them: a sampler that does not follow its schedule step by step (an `s_churn`, a second evaluation per step) shows at
    its first such call, and `mismatch` then says how."""

    def __init__(self):
        self.pending: deque = deque()
        self.mismatch: str | None = None

    def expect(self, sigma: torch.Tensor, predicted: float) -> None:
        self.pending.append((DeferredFloats([sigma]), predicted))

    def poll(self) -> str | None:
        while self.mismatch is None and self.pending and self.pending[0][0].ready():
            read, predicted = self.pending.popleft()
            actual = read.values()[0]
            if any(value != predicted for value in actual):
                self.mismatch = f"a call at sigma {max(actual):.6g} in the step whose schedule sigma is {predicted:.6g}"
                self.pending.clear()
        return self.mismatch
