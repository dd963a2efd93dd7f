"""Which attention runs at a shape: SDPA as torch picks it, a faster 16-bit kernel, or an 8-bit backend, chosen once
per shape, dtype and GPU by measuring them on the call's own inputs, as QuantizeModel's `min_speedup` and error
thresholds decide per layer.

At the first call of a shape each applicable backend runs on those inputs: its relative error against SDPA's
output (at its second call, as later calls run), and its time (median of a few runs, CUDA events). `auto` takes the
fastest backend within the error bound that beats SDPA by 3 %; `exact` the same among the 16-bit kernels only (SDPA's
cuDNN kernel, FlashAttention-3: SDPA's result to 16-bit rounding; Compile Model's choice); `8bit` the fastest 8-bit
backend within the bound even when SDPA is faster; `sdpa` never measures. The choice is logged with its figures and
kept for the process. A backend that fails is never tried again at that shape.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core.errors import OverdriveError
from ..core.registry import Registry
from . import cudnn8, fa3, fa3_fp8, triton8
from .reference import relative_error
from .video_sparsity import VideoSparsity

log = logging.getLogger("overdrive")

MODES = ("auto", "exact", "sdpa", "8bit")
MIN_SPEEDUP = 1.03  # auto, exact: a backend must beat SDPA by this much (timing noise is ~1 %)
# The bound of `exact`: a 16-bit kernel differs from SDPA's by rounding (~0.3 % per call); more means it is broken.
EXACT_MAX_ERROR = 0.01


class AttentionConfigError(OverdriveError, ValueError):
    """Bad attention settings: the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    mode: str = "auto"
    # Relative error per call, against SDPA on the same inputs. The default admits cuDNN's fp8 attention on Flux's and
    # Qwen-Image's own inputs, which left the whole model call's error and the final latent's unchanged next to the fp8
    # GEMMs' (bench/experiments/fp8-against-compile-model.md); a tighter bound kept SDPA on both.
    max_error: float = 0.05
    # Where cuDNN's fp8 graph is chosen, a block traced at that shape takes its e4m3 output and dequantizes it in the
    # compiled code (e4m3_output.py). Off: the backend's own 16-bit output (bench/bench_compile.py's A/B).
    e4m3_output: bool = True
    # A video model's self-attention over its frames, masked by frame distance (video_sparsity.py; ComfyUI's nodes
    # only, which read the video grid from the model's call). None: dense.
    video: VideoSparsity | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise AttentionConfigError(f"attention mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 0.0 < self.max_error <= 1.0:
            raise AttentionConfigError(f"attention_max_error must be in (0, 1], got {self.max_error}: it is a "
                                       "relative error per call (0.05 = 5 %)")


class OnePerConfig:
    """Overdrive's attention entry points (ComfyUI's override, the SDPA routing mode): one instance per AttentionConfig,
    shared by every model with those settings, since compiled code guards on the instance; a precompiled frame that
    traced one is keyed by its settings (`precompile_key`)."""

    def __new__(cls, config: AttentionConfig):
        instances = cls.__dict__.get("_instances")
        if instances is None:
            instances = cls._instances = {}
        made = instances.get(config)
        if made is None:
            made = instances[config] = super().__new__(cls)
            made.config = config
        return made

    @property
    def precompile_key(self) -> tuple:
        return dataclasses.astuple(self.config)

    def __deepcopy__(self, memo):  # ModelPatcher.clone deep-copies model_options: keep the one instance
        return self

    def __reduce__(self):  # another process (Parallel Model's workers) unpickles its own one instance per settings
        return type(self), (self.config,)


def sdpa(q, k, v):
    """torch's best 16-bit attention, in the backends' output layout (batch, tokens, heads, head dim)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()


def sdpa_cudnn(q, k, v):
    """SDPA on cuDNN's fused kernel, which torch does not pick by itself."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return sdpa(q, k, v)


def cuda_16_bit(q, k, v):
    """None where SDPA's cuDNN kernel may run, else why not (torch says so itself at the call)."""
    return None if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "needs 16-bit CUDA tensors"


@dataclasses.dataclass(frozen=True)
class Backend:
    applies: object  # (q, k, v) -> None, or why it does not run there
    run: object  # (q, k, v) -> (batch, tokens, heads, head dim)
    exact: bool  # a 16-bit kernel (`exact` mode's), else an 8-bit one


BACKENDS = Registry("attention backend")  # measured in this order
BACKENDS.register("sdpa_cudnn", Backend(cuda_16_bit, sdpa_cudnn, exact=True))
BACKENDS.register("fa3_bf16", Backend(fa3.supports, fa3.attention, exact=True))
BACKENDS.register("int8_fp8", Backend(triton8.supports, lambda q, k, v: triton8.attention(q, k, v, pv="fp8"),
                                      exact=False))
BACKENDS.register("int8_fp16", Backend(triton8.supports, lambda q, k, v: triton8.attention(q, k, v, pv="fp16"),
                                       exact=False))
BACKENDS.register("cudnn_fp8", Backend(cudnn8.supports, cudnn8.attention, exact=False))
BACKENDS.register("fa3_fp8", Backend(fa3_fp8.supports, fa3_fp8.attention, exact=False))


def considered(config: AttentionConfig) -> list:
    """The backends a mode measures."""
    if config.mode == "sdpa":
        return []
    return [name for name, backend in BACKENDS.items()
            if config.mode == "auto" or backend.exact == (config.mode == "exact")]


@dataclasses.dataclass
class Measurement:
    backend: str
    ms: float | None = None
    rel_err: float | None = None
    failed: str | None = None


def bound(exact: bool, config: AttentionConfig) -> float:
    """The error a backend may show at a shape: the user's bound, and at most EXACT_MAX_ERROR for a 16-bit kernel."""
    return min(config.max_error, EXACT_MAX_ERROR) if exact else config.max_error


def pick(measurements: list, sdpa_ms: float, config: AttentionConfig) -> str:
    """The backend for a shape from its measurements (pure: the rule the docstring above states)."""
    if config.mode == "sdpa":
        return "sdpa"
    names = considered(config)
    within = [m for m in measurements if m.backend in names and m.failed is None and m.rel_err is not None
              and m.rel_err <= bound(BACKENDS[m.backend].exact, config)]
    if config.mode in ("auto", "exact"):
        within = [m for m in within if m.ms * MIN_SPEEDUP <= sdpa_ms]
    return min(within, key=lambda m: m.ms).backend if within else "sdpa"


HOST_AHEAD_CYCLES = 20_000_000  # ~10 ms of GPU sleep queued before each timing: more than its calls' launch time


def _median_ms(fn, reps: int = 5, calls: int = 4) -> float:
    """GPU milliseconds per call: the median of `reps` timings of `calls` back-to-back calls, each timing queued
    behind a GPU sleep so that the host has launched them all before the first starts. A backend's launch time
    (inside a model the host runs ahead of the GPU) then does not count against it: without the sleep, a backend
    of many short launches is timed at the host's pace."""
    fn()
    sleep = getattr(torch.cuda, "_sleep", None)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(HOST_AHEAD_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


class Chooser:
    """Per (shape, dtype, device, config) the backend to run; measured at the first call."""

    def __init__(self):
        self.choices: dict = {}
        self.reports: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(q, k, config: AttentionConfig) -> tuple:
        return tuple(q.shape), tuple(k.shape), str(q.dtype), str(q.device), config

    def backend(self, q, k, v, config: AttentionConfig) -> str:
        key = self._key(q, k, config)
        choice = self.choices.get(key)
        if choice is not None:
            return choice
        if config.mode == "sdpa" or not q.is_cuda or torch.cuda.is_current_stream_capturing():
            return "sdpa"  # nothing to measure here (a CUDA graph records the warm-up's choice, made before)
        with self._lock:
            if key not in self.choices:
                self.choices[key] = self._measure(key, q, k, v, config)
        return self.choices[key]

    def failed(self, q, k, v, config: AttentionConfig, backend: str, error: Exception) -> None:
        self.choices[self._key(q, k, config)] = "sdpa"
        log.warning("Overdrive attention: %s failed at %s (%s: %s); SDPA runs there from now on", backend,
                    tuple(q.shape), type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "")

    def _measure(self, key, q, k, v, config: AttentionConfig) -> str:
        ref = sdpa(q, k, v)
        sdpa_ms = _median_ms(lambda: sdpa(q, k, v))
        measurements = []
        for name in considered(config):
            applies, run = BACKENDS[name].applies, BACKENDS[name].run
            why = applies(q, k, v)
            if why is not None:
                measurements.append(Measurement(name, failed=why))
                continue
            try:
                run(q, k, v)  # a shape's first call builds what later calls reuse (cuDNN's graph, carried scales)
                out = run(q, k, v)  # so the error is the steady state's
                measurements.append(Measurement(name, ms=_median_ms(lambda: run(q, k, v)),
                                                rel_err=relative_error(out, ref)))
            except Exception as error:  # noqa: BLE001 - a backend that cannot run here is skipped, SDPA stays
                measurements.append(Measurement(name, failed=f"{type(error).__name__}: {str(error)[:200]}"))
        choice = pick(measurements, sdpa_ms, config)
        self.reports[key] = (sdpa_ms, measurements, choice)
        figures = "; ".join(
            f"{m.backend} {m.ms:.3f} ms ({sdpa_ms / m.ms:.2f}x), error {m.rel_err:.2%}" if m.failed is None
            else f"{m.backend}: {m.failed}" for m in measurements)
        log.info("Overdrive attention %s %s, mode %s, error bound %.1f%%: SDPA %.3f ms; %s -> %s", tuple(q.shape),
                 str(q.dtype).replace("torch.", ""), config.mode, 100 * bound(config.mode == "exact", config), sdpa_ms,
                 figures, choice)
        return choice


CHOOSER = Chooser()
