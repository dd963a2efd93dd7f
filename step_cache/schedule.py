"""Which model calls (UNet or DiT) run the full model and which the shallow one, and what happened in each run.

A *step* is one distinct sigma: every call at the same sigma (cond and uncond, batched together or called one after
the other; a second-order sampler's repeat evaluation at that sigma) shares the decision of the first. The decision is
keyed on the sigma value, never on a call counter, so the way ComfyUI batches conds does not change the schedule.
(Second-order samplers that evaluate an intermediate sigma count it as a step of its own.)

A *run* (one sampling process) starts at the first call, and again whenever sigma goes up compared with the last step
or the run key changes (latent shape, dtype, device, the sampler's sigma list where the caller knows it): the runner
then drops every cached feature.

Within a run, step k is full when it is outside [start_percent, end_percent] (as sigmas), or when it is the j-th step
inside that window with j % cache_interval == 0; so the first step of a run, and the first step inside the window,
are always full. In the adaptive and calibrated modes the steps inside the window after its first are decided by the
caller once it has measured the step, or replays its decision (`settle`).
"""
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import torch

from .config import DeepCacheConfig, DeepCacheConfigError

log = logging.getLogger("overdrive.step_cache")


class DeferredFloats:
    """Tensors' values as Python floats, copied from the device in one transfer that is queued now and waited for
    only when `values()` is first called, so the host can queue more GPU work in between. (A blocking read makes
    the host wait until the GPU has run everything queued before it, and leaves the GPU idle while the host then
    prepares the next kernels.)"""

    def __init__(self, tensors: list):
        flat = [t.detach().reshape(-1) for t in tensors]
        self._sizes = [f.numel() for f in flat]
        device = flat[0].device
        staged = torch.cat([f.to(device=device, dtype=torch.float64) for f in flat])
        self._ready = None
        if staged.is_cuda:
            self._host = torch.empty(staged.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(staged, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = staged
        self._values = None

    def ready(self) -> bool:
        """Whether `values()` can return without waiting for the GPU."""
        return self._ready is None or self._ready.query()

    def values(self) -> list[list[float]]:
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            flat, self._values, start = self._host.tolist(), [], 0
            for size in self._sizes:
                self._values.append(flat[start:start + size])
                start += size
        return self._values


def host_floats(tensors: list) -> list[list[float]]:
    """Each tensor's values as Python floats, read from the device in one sync for all of them (a sync per tensor
    would stall the GPU queue once more per model call for each)."""
    return DeferredFloats(tensors).values()


@dataclass(frozen=True)
class StepDecision:
    full: bool        # run the full UNet (and record the feature at the cache point)
    step: int         # index of this step in the run (0 = first)
    sigma: float
    in_window: bool   # inside [start_percent, end_percent]
    new_step: bool    # this is the first call at this sigma
    new_run: bool     # this call started a new run (all cached features must go)


@dataclass
class RunStats:
    steps: int = 0
    full_steps: int = 0
    shallow_steps: int = 0
    full_calls: int = 0       # calls that ran the full path because the step was full
    shallow_calls: int = 0    # calls that reused a cached feature
    fallback_calls: int = 0   # calls in a shallow step that had to run full anyway
    fallback_reasons: Counter = field(default_factory=Counter)
    decisions: list = field(default_factory=list)  # per step: True = full
    # the most the cache held between steps in this run (features, residuals, references): GPU memory beside the
    # model's own, which the card's budget must leave room for
    kept_bytes: int = 0

    def note_kept(self, nbytes: int) -> None:
        self.kept_bytes = max(self.kept_bytes, nbytes)


class DeepCacheSchedule:
    """Per-call full/shallow decisions, run detection and per-run counts.

    `percent_to_sigma` maps ComfyUI's sampling percent (0 = start, 1 = end) to sigma, decreasing; in ComfyUI it is
    `model.model_sampling.percent_to_sigma`. It is only needed when the config narrows the window.
    """

    def __init__(self, config: DeepCacheConfig, percent_to_sigma: Callable[[float], float] | None = None):
        self.config = config
        if not config.full_window and percent_to_sigma is None:
            raise DeepCacheConfigError(
                f"start_percent={config.start_percent}, end_percent={config.end_percent} need a percent_to_sigma "
                "function to turn them into sigmas (in ComfyUI: model.model_sampling.percent_to_sigma)")
        self.percent_to_sigma = percent_to_sigma
        self._resolve_window()
        self.run_key: Hashable = None
        self.runs = 0
        self.stats = RunStats()
        self._current: StepDecision | None = None
        self._window_steps = 0
        self._planned: list[bool] | None = None
        self.last_stats: RunStats | None = None  # of the last run that ended
        self._force_new_run = False

    def _resolve_window(self) -> None:
        """Sigmas of the window; redone at every run start, since the model's sampling (and so percent_to_sigma's
        answer) may be patched between runs (ComfyUI's ModelSamplingDiscrete and similar nodes)."""
        config = self.config
        if config.full_window:
            self.sigma_start, self.sigma_end = math.inf, -math.inf
            return
        p2s = self.percent_to_sigma
        self.sigma_start = math.inf if config.start_percent <= 0.0 else float(p2s(config.start_percent))
        self.sigma_end = -math.inf if config.end_percent >= 1.0 else float(p2s(config.end_percent))
        if self.sigma_start < self.sigma_end:
            raise DeepCacheConfigError(
                f"percent_to_sigma must decrease: start_percent {config.start_percent} -> sigma {self.sigma_start}, "
                f"end_percent {config.end_percent} -> sigma {self.sigma_end}")

    # -- the rule ------------------------------------------------------------------------------------------------
    def in_window(self, sigma: float) -> bool:
        return self.sigma_end <= sigma <= self.sigma_start

    def _full(self, in_window: bool, window_index: int) -> bool:
        interval = window_index + 1 if self.config.measured else self.config.cache_interval
        return (not in_window) or window_index % interval == 0

    def settle(self, full: bool) -> None:
        """The measured (or replayed) decision for the current step, made after its first blocks ran."""
        current = self._current
        if current is None or current.full == full:
            return
        self._current = StepDecision(full, current.step, current.sigma, current.in_window, False, False)
        self.stats.decisions[-1] = full
        self.stats.full_steps += 1 if full else -1
        self.stats.shallow_steps += -1 if full else 1

    def plan(self, sigmas: Iterable[float]) -> list[bool]:
        """The decisions (True = full) for one run over the sigmas at which the model is evaluated, in order
        (for a ComfyUI sigma schedule, which ends with 0, pass `sigmas[:-1]`). Repeated sigmas share a step."""
        out, window_index, last = [], 0, None
        for sigma in (float(s) for s in sigmas):
            if last is not None and sigma == last:
                continue
            inside = self.in_window(sigma)
            out.append(self._full(inside, window_index))
            window_index += inside
            last = sigma
        return out

    # -- per call ------------------------------------------------------------------------------------------------
    def decide(self, sigma: float, run_key: Hashable = None) -> StepDecision:
        """The decision for a call at `sigma`; starts a new run when sigma went up or the run key changed."""
        sigma = float(sigma)
        new_run = False
        if (self.runs == 0 or self._force_new_run or run_key != self.run_key
                or (self._current is not None and sigma > self._current.sigma)):
            self._start_run(run_key)
            new_run = True
        current = self._current
        if current is not None and sigma == current.sigma:
            return StepDecision(current.full, current.step, sigma, current.in_window, False, new_run)
        inside = self.in_window(sigma)
        full = self._full(inside, self._window_steps)
        self._window_steps += inside
        decision = StepDecision(full, self.stats.steps, sigma, inside, True, new_run)
        self.stats.steps += 1
        self.stats.decisions.append(full)
        if full:
            self.stats.full_steps += 1
        else:
            self.stats.shallow_steps += 1
        self._current = decision
        return decision

    def note_call(self, kind: str, reason: str | None = None) -> None:
        """Count one call: kind is "full", "shallow" or "fallback" (a call of a shallow step that ran full)."""
        if kind == "full":
            self.stats.full_calls += 1
        elif kind == "shallow":
            self.stats.shallow_calls += 1
        elif kind == "fallback":
            self.stats.fallback_calls += 1
            self.stats.fallback_reasons[reason or "unspecified"] += 1
        else:
            raise ValueError(f"unknown call kind {kind!r}")

    def set_plan(self, sigmas: Iterable[float]) -> None:
        """The caller knows this run's sigmas (newer ComfyUI: transformer_options["sample_sigmas"]): log the plan."""
        self._planned = self.plan(sigmas)
        full = sum(self._planned)
        log.info("DeepCache: %d steps, %d full / %d shallow, %s (planned)", len(self._planned), full,
                 len(self._planned) - full, self.config.describe())

    # -- runs ----------------------------------------------------------------------------------------------------
    def summary(self, stats: RunStats | None = None) -> str:
        s = stats or self.stats
        line = (f"DeepCache: {s.steps} steps, {s.full_steps} full / {s.shallow_steps} shallow, "
                f"{self.config.describe()}; "
                f"{s.full_calls + s.shallow_calls + s.fallback_calls} model calls: {s.full_calls} full, "
                f"{s.shallow_calls} shallow")
        if s.fallback_calls:
            reasons = "; ".join(f"{n}x {r}" for r, n in s.fallback_reasons.most_common())
            line += f", {s.fallback_calls} ran full in shallow steps ({reasons})"
        if s.kept_bytes:
            line += f"; kept {s.kept_bytes / 2**20:.2f} MiB between steps"
        return line

    def end_run(self) -> RunStats | None:
        """Close the current run (logs its summary once); returns its stats, or None if it had no step."""
        stats = self.stats
        if stats.steps == 0:
            return None
        planned_as_run = (self._planned is not None and sum(self._planned) == stats.full_steps
                          and not stats.fallback_calls)
        (log.debug if planned_as_run else log.info)(self.summary(stats))
        self.stats = RunStats()
        self.last_stats = stats
        self._current = None
        self._window_steps = 0
        self._planned = None
        return stats

    def reset(self) -> None:
        """End the current run (logging its summary); the next call starts a new one whatever its sigma."""
        self.end_run()
        self._force_new_run = True

    def _start_run(self, run_key: Hashable) -> None:
        self.end_run()
        self._force_new_run = False
        self._resolve_window()
        self.run_key = run_key
        self.runs += 1
        self.stats = RunStats()
        self._current = None
        self._window_steps = 0
        self._planned = None
