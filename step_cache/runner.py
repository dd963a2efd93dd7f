"""DeepCacheRunner: a drop-in callable for the UNet's forward that runs full or shallow steps and keeps the cache."""
import logging
import threading
from collections import Counter

import torch

from ..core.call_options import NO_CALL_OPTIONS
from ..core.errors import OverdriveError
from .cache import FeatureCache
from .clock import StepClockCheck
from .config import DeepCacheConfig, DeepCacheConfigError
from .paths import CallInfo, UNetPaths
from .schedule import DeepCacheSchedule, RunStats, host_floats

log = logging.getLogger("overdrive.step_cache")

# The eager mirror must reproduce the model's own eager forward; any real divergence is far larger than this.
VERIFY_RTOL = 1e-5


class DeepCacheUnsupportedError(OverdriveError, RuntimeError):
    """A call DeepCache cannot serve exactly, with DeepCacheConfig(on_unsupported="error")."""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class DeepCacheRunner:
    """Call it like the UNet's forward. Thread-safe bookkeeping; the model itself is never modified.

    paths: a UNetPaths adapter (`OpenAIUNetPaths` for ComfyUI's UNetModel, `DiffusersUNetPaths` for diffusers'
        UNet2DConditionModel).
    percent_to_sigma: needed when the config narrows [start_percent, end_percent] (ComfyUI:
        model.model_sampling.percent_to_sigma).
    native_forward: what to run for calls DeepCache cannot serve (default: the UNet class's own forward). Pass the
        forward the model had before DeepCache was installed if it was already replaced (e.g. a compiled one).
    """

    overdrive_stack = None  # set by stack.build

    def __init__(self, paths: UNetPaths, config: DeepCacheConfig | None = None, *, percent_to_sigma=None,
                 native_forward=None, call_options=NO_CALL_OPTIONS):
        self.config = config or DeepCacheConfig()
        self.call_options = call_options
        if getattr(paths, "depth", self.config.cache_depth) != self.config.cache_depth:
            raise DeepCacheConfigError(f"paths were built for depth {paths.depth}, "
                                       f"config says {self.config.cache_depth}")
        self.paths = paths
        self.schedule = DeepCacheSchedule(self.config, percent_to_sigma)
        self.cache = FeatureCache()
        self.full_path = paths.full_forward
        self.shallow_path = paths.shallow_forward
        self.native = native_forward if native_forward is not None else paths.native_forward
        self.disabled: str | None = None  # set when verification found the mirror wrong for this model
        self._verified: set = set()
        self._warned: set = set()
        self._occurrences: Counter = Counter()
        self._lock = threading.RLock()
        self._clock = None  # the StepClock of the run in progress, when the caller keeps one
        self._clock_check = StepClockCheck()

    @classmethod
    def for_openai_unet(cls, unet, config: DeepCacheConfig | None = None, *, forward_timestep_embed, timestep_embedding,
                        percent_to_sigma=None, native_forward=None, call_options=NO_CALL_OPTIONS) -> "DeepCacheRunner":
        """Over ComfyUI's openaimodel UNet; `call_options`: how its calls carry transformer_options (the ComfyUI
        host's description, core/call_options.py)."""
        from .unet_openai import OpenAIUNetPaths
        config = config or DeepCacheConfig()
        paths = OpenAIUNetPaths(unet, config.cache_depth, forward_timestep_embed, timestep_embedding)
        return cls(paths, config, percent_to_sigma=percent_to_sigma, native_forward=native_forward,
                   call_options=call_options)

    @classmethod
    def for_diffusers_unet(cls, unet, config: DeepCacheConfig | None = None, *, num_train_timesteps: int = 1000,
                           native_forward=None) -> "DeepCacheRunner":
        """Over a diffusers UNet2DConditionModel; steps are keyed on the timestep (diffusers passes no sigmas), and
        start/end_percent map onto the `num_train_timesteps` axis as in ComfyUI (0 -> the last timestep, 1 -> 0)."""
        from .unet_diffusers import DiffusersUNetPaths
        config = config or DeepCacheConfig()
        paths = DiffusersUNetPaths(unet, config.cache_depth, num_train_timesteps)
        return cls(paths, config, percent_to_sigma=paths.percent_to_timestep, native_forward=native_forward)

    def clone(self, native_forward=None) -> "DeepCacheRunner":
        """A runner over the same paths and settings with its own (empty) schedule and cache, eager paths, and
        `native_forward` (default: this one's). For a node that wraps a model already carrying a runner, e.g. a
        compile node downstream of DeepCache, which then routes `full_path` and `shallow_path` through compiled code."""
        return DeepCacheRunner(self.paths, self.config, percent_to_sigma=self.schedule.percent_to_sigma,
                               native_forward=native_forward if native_forward is not None else self.native,
                               call_options=self.call_options)

    def __deepcopy__(self, memo):
        """Deep-copying a model whose forward is this runner (a ModelPatcher object patch) gives the copy a fresh
        runner over the copied UNet, with eager paths; a custom native_forward is kept as it is."""
        import copy
        paths = copy.deepcopy(self.paths, memo)
        native = None if self.native == self.paths.native_forward else self.native
        copied = DeepCacheRunner(paths, self.config, percent_to_sigma=self.schedule.percent_to_sigma,
                                 native_forward=native, call_options=self.call_options)
        copied.overdrive_stack = self.overdrive_stack
        return copied

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    @property
    def stats(self) -> RunStats:
        """Counts of the current run (see `last_stats` for the previous one)."""
        return self.schedule.stats

    @property
    def last_stats(self) -> RunStats | None:
        return self.schedule.last_stats

    def reset(self, new_weights: bool = False) -> None:
        """End the current run (logs its summary) and drop every cached feature; the next call starts a new run.
        (`new_weights`: the DiT step cache's signature; a UNet's features are all dropped either way.)"""
        with self._lock:
            self.schedule.reset()
            self.cache.clear()
            self._occurrences.clear()

    end_run = reset

    # -- the call ------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.disabled is not None:
            return self.native(*args, **kwargs)
        info = self.paths.inspect(args, kwargs)
        sigmas, fingerprint, sample_sigmas = self._from_clock(info) or self._read(info)
        unsupported = info.unsupported
        if unsupported is None and len(set(sigmas)) > 1:
            unsupported = "per-sample sigmas differ within the batch"
        with self._lock:
            run_key = info.run_key + (tuple(sample_sigmas) if sample_sigmas is not None else None,)
            decision = self.schedule.decide(max(sigmas) if sigmas else 0.0, run_key)
            if decision.new_run:
                self.cache.clear()
                if sample_sigmas is not None and len(sample_sigmas) > 1:
                    self.schedule.set_plan(sample_sigmas[:-1])
            if decision.new_step:
                self._occurrences.clear()
                if decision.full:
                    self.cache.clear()  # a full step replaces every feature; older ones are never reused
            key = info.layout + (tuple(fingerprint),)
            occurrence = self._occurrences[key]
            self._occurrences[key] += 1
            cached = None if decision.full else self.cache.get(key, occurrence)

        if unsupported is not None:
            return self._native_call(decision.full, unsupported, args, kwargs)
        if cached is None:
            out, feature = self._full_call(info, args, kwargs)
            with self._lock:
                if feature is not None:
                    self.cache.put(key, occurrence, feature)
                    self.schedule.stats.note_kept(self.cache.nbytes())
                if decision.full:
                    self.schedule.note_call("full")
                else:
                    self.schedule.note_call("fallback", "no cached feature for this batch layout")
            return info.finish(out) if info.finish is not None else out
        out = self.shallow_path(cached, *info.path_args, **info.path_kwargs)
        with self._lock:
            self.schedule.note_call("shallow")
        return info.finish(out) if info.finish is not None else out

    def _read(self, info: CallInfo):
        """Sigmas, conditioning fingerprint and the run's sigma list, as Python floats (one device sync)."""
        sample = [info.sample_sigmas] if info.sample_sigmas is not None else []
        sigmas, *rest = host_floats([info.sigma, *info.fingerprint, *sample])
        fingerprint = [value for values in rest[:len(info.fingerprint)] for value in values]
        return sigmas, fingerprint, (rest[-1] if sample else None)

    def _from_clock(self, info: CallInfo):
        """As `_read`, without waiting for the GPU, from the caller's StepClock: the step's sigma from the run's
        schedule, the conditioning named by the caller's host ids. None (then `_read`) without a clock, past the
        schedule's end, or once the clock has proven not to match the sampler's calls."""
        clock = info.clock
        if clock is None or info.host_fingerprint is None:
            return None
        mismatch = self._clock_check.poll()
        if mismatch is not None:
            if "clock" not in self._warned:
                self._warned.add("clock")
                log.warning("DeepCache: this sampler's model calls do not follow its sigma schedule step by step (%s); "
                            "each call's sigma is read from the GPU from now on (exact, but the host waits a step)",
                            mismatch)
            return None
        sigma = clock.sigma()
        if sigma is None:
            return None
        with self._lock:
            if clock is not self._clock:  # a sampling run of its own, whatever its sigmas
                self._clock = clock
                self.schedule.reset()
        self._clock_check.expect(info.sigma, sigma)
        return [sigma], list(info.host_fingerprint), clock.values()

    def _native_call(self, full_step: bool, reason: str, args, kwargs):
        if self.config.on_unsupported == "error":
            raise DeepCacheUnsupportedError(
                f"DeepCache cannot run this UNet call exactly: {reason}. Remove DeepCache from this workflow, or set "
                "on_unsupported='full' to run such calls as full forwards.")
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("DeepCache: %s; those calls run the model's own full forward (exact, not accelerated)", reason)
        with self._lock:
            self.schedule.note_call("full" if full_step else "fallback", reason)
        return self.native(*args, **kwargs)

    def _full_call(self, info: CallInfo, args, kwargs):
        kind = info.kind or self._kind(info)
        if not self.config.verify or kind in self._verified:
            return self.full_path(*info.path_args, **info.path_kwargs)
        # First full call of this kind: the eager mirror must reproduce the model's own eager forward. Both run on
        # copies of the call's options, so the caller's dict (and a compiled path's guards) see one ordinary call.
        reference = self.paths.reference_forward(args, kwargs)
        mirror_kwargs = dict(info.path_kwargs)
        keyword = self.call_options.keyword
        if isinstance(mirror_kwargs.get(keyword), dict):
            mirror_kwargs[keyword] = dict(mirror_kwargs[keyword])
        eager = self.full_path == self.paths.full_forward
        mirrored, feature = self.paths.full_forward(*info.path_args, **mirror_kwargs)
        error = relative_error(mirrored, reference) if mirrored.shape == reference.shape else float("inf")
        if not error <= VERIFY_RTOL:
            name = type(getattr(self.paths, "unet", self.paths)).__name__
            self.disabled = (f"DeepCache's mirrored forward of {name} differs from the model's own forward (relative "
                             f"error {error:.3g}, call kind {kind}); the installed version's UNet forward is not the one "
                             "DeepCache mirrors")
            log.error("%s. DeepCache is OFF for this model: every step runs the model's own forward.", self.disabled)
            if self.config.on_unsupported == "error":
                raise DeepCacheUnsupportedError(self.disabled)
            return reference, None
        self._verified.add(kind)
        log.debug("DeepCache: mirrored forward verified against the model's own (relative error %.3g, %s)", error, kind)
        if eager:
            return mirrored, feature
        return self.full_path(*info.path_args, **info.path_kwargs)

    def _kind(self, info: CallInfo) -> tuple:
        """What makes two calls exercise different code in the mirror: active patches, extra inputs, dtype."""
        described = self.call_options
        kwargs = info.path_kwargs
        extra = tuple(sorted(k for k, v in described.without(kwargs).items() if v is not None))
        x = info.path_args[0] if info.path_args else None
        return described.patches(described.of(kwargs)), extra, str(getattr(x, "dtype", None))
