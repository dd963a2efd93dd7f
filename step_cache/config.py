"""DeepCache settings, validated on construction (the depth against a concrete UNet by its paths, unet_*.py).

Terms used throughout `overdrive.step_cache`, for an openaimodel-style UNet (ComfyUI's UNetModel) whose
`input_blocks[i]` feeds its output, through a skip connection, to `output_blocks[N - 1 - i]`:

* A *skip branch* is one such pair. Branch 1 is the outermost (input_blocks[0], the stem conv, paired with
  output_blocks[N-1], the last full-resolution block); branch N is the innermost.
* `cache_depth = d` keeps the d outermost branches. A *shallow* step runs only input_blocks[:d],
  output_blocks[N-d:] and `out`; everything between (input_blocks[d:], middle_block, output_blocks[:N-d]) is
  skipped, and output_blocks[N-d] receives, in place of the output of output_blocks[N-d-1], that feature as
  recorded at the last *full* step (the feature "at the cache point").
* The paper's setting for Stable Diffusion (cache interval 3, the shallowest skip branch; "branch 0" in its
  zero-based numbering) is `cache_depth=1`: on SD1.5 a shallow step then costs the stem conv, one
  ResBlock + SpatialTransformer at full latent resolution and the output conv, about a tenth of the UNet's
  multiply-adds, which is what makes its speed-up at interval 3 possible. Larger depths are closer to the full model and
  slower.
"""
from dataclasses import dataclass, replace

from ..core.errors import OverdriveError

ON_UNSUPPORTED = ("full", "error")
MODES = ("auto", "fixed", "adaptive", "calibrated")
MEASURED = ("adaptive", "calibrated")  # the modes that measure the first blocks' change


class DeepCacheConfigError(OverdriveError, ValueError):
    """A DeepCache setting is out of range (the message says which and why)."""


@dataclass(frozen=True)
class DeepCacheConfig:
    """What DeepCache does; see the module docstring for `cache_depth`.

    cache_interval: a full UNet forward every this many sampling steps (1 = every step, i.e. no caching).
    cache_depth: how many of the outermost skip branches run on shallow steps (1 = the paper's SD setting).
    start_percent, end_percent: the part of the sampling process (0 = first step, 1 = last, ComfyUI's convention)
        where caching is allowed; outside it every step is full.
    verify: on the first full call (per combination of patches/extra inputs), also run the model's own forward
        eagerly and compare: if DeepCache's mirrored forward disagrees (e.g. a newer ComfyUI changed the UNet's
        forward), DeepCache switches itself off for this model with an error in the log.
    on_unsupported: what to do with a call DeepCache cannot serve exactly (ControlNet/T2I residuals, a patch or
        wrapper it does not know, per-sample sigmas): "full" runs the model's own full forward for that call (the
        image stays exact; that step is not accelerated), "error" raises DeepCacheUnsupportedError.
    mode: "auto" is "fixed" on UNets and "calibrated" on DiTs at their family's `step_cache_threshold` (chosen from
        the fidelity table of the reference models with learned weights; `threshold` is then not read). "fixed" follows
        cache_interval; "adaptive" (DiT families, step_cache/block_cache.py) reuses a step whenever
        the output of the blocks that always run has changed by less than `threshold` (mean absolute change relative
        to its mean magnitude) since the last full step, and ignores cache_interval. "calibrated" decides so at the
        first run of each sampling schedule (latent shape and sigmas) and replays those decisions on later runs of
        it, which then measure nothing and so never wait on the GPU.
    threshold: the adaptive and calibrated modes' bound on that relative change.
    """

    cache_interval: int = 3
    cache_depth: int = 1
    start_percent: float = 0.0
    end_percent: float = 1.0
    verify: bool = True
    on_unsupported: str = "full"
    mode: str = "auto"
    threshold: float = 0.2  # the MMDiT family's (families/family.py, step_cache_threshold)

    def __post_init__(self):
        if isinstance(self.cache_interval, bool) or not isinstance(self.cache_interval, int):
            raise DeepCacheConfigError(f"cache_interval must be an int, got {self.cache_interval!r}")
        if self.cache_interval < 1:
            raise DeepCacheConfigError(f"cache_interval must be >= 1 (1 = a full forward at every step), "
                                       f"got {self.cache_interval}")
        if isinstance(self.cache_depth, bool) or not isinstance(self.cache_depth, int):
            raise DeepCacheConfigError(f"cache_depth must be an int, got {self.cache_depth!r}")
        if self.cache_depth < 1:
            raise DeepCacheConfigError(f"cache_depth must be >= 1 (1 = only the outermost skip branch runs on "
                                       f"shallow steps), got {self.cache_depth}")
        for name in ("start_percent", "end_percent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise DeepCacheConfigError(f"{name} must be a number in [0, 1], got {value!r}")
        if self.start_percent >= self.end_percent:
            raise DeepCacheConfigError(f"start_percent ({self.start_percent}) must be < end_percent "
                                       f"({self.end_percent}): the caching window would be empty")
        if self.mode not in MODES:
            raise DeepCacheConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise DeepCacheConfigError(f"threshold must be a number >= 0, got {self.threshold!r}")
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise DeepCacheConfigError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {self.on_unsupported!r}")

    @property
    def full_window(self) -> bool:
        """True when caching is allowed over the whole sampling process."""
        return self.start_percent <= 0.0 and self.end_percent >= 1.0

    def for_family(self, threshold: float) -> "DeepCacheConfig":
        """The settings a DiT of a family whose calibrated threshold is `threshold` runs: "auto" made concrete."""
        return replace(self, mode="calibrated", threshold=threshold) if self.mode == "auto" else self

    @property
    def measured(self) -> bool:
        """Whether steps are decided by the first blocks' measured change (at least at a schedule's first run)."""
        return self.mode in MEASURED

    def describe(self) -> str:
        window = "" if self.full_window else f", window {self.start_percent:g}-{self.end_percent:g}"
        rule = f"{self.mode}, threshold {self.threshold:g}" if self.measured else f"interval {self.cache_interval}"
        return f"{rule}, depth {self.cache_depth}{window}"
