"""What a UNet adapter gives the runner: how to read a call, and the full and shallow paths.

`DeepCacheRunner` is generic; one adapter per UNet family implements `UNetPaths`: `unet_openai.OpenAIUNetPaths`
for ComfyUI's openaimodel UNet (input_blocks/middle_block/output_blocks), `unet_diffusers.DiffusersUNetPaths` for
diffusers' UNet2DConditionModel (down_blocks/mid_block/up_blocks).
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


@dataclass
class CallInfo:
    """One UNet call, as the runner needs to see it."""
    sigma: torch.Tensor                  # per-sample sigma (or timestep: anything monotonic in sigma) of this call
    run_key: tuple                       # a change starts a new run (shape, dtype, device, ...)
    layout: tuple                        # which cached feature this call may reuse (batch size, cond_or_uncond, ...)
    path_args: tuple                     # full_forward(*path_args, **path_kwargs);
    path_kwargs: dict                    # shallow_forward(cached, *path_args, **path_kwargs)
    fingerprint: list = field(default_factory=list)  # small tensors naming the conditioning (values join the layout)
    unsupported: str | None = None       # why this call cannot be served by the paths (it then runs the native forward)
    sample_sigmas: torch.Tensor | None = None  # the run's whole sigma schedule, when the caller passes it
    kind: tuple | None = None            # what the first-call verification is keyed on (None: the runner's default)
    finish: Callable | None = None       # applied to a path's output before it is returned (e.g. the caller's
                                         # return type); the native forward's output is returned as it is
    clock: Any = None                    # the caller's StepClock (step_cache/clock.py), if it keeps one
    host_fingerprint: tuple | None = None  # the conditioning named on the host (ComfyUI's cond uuids): with a clock,
                                         # in place of `fingerprint`, whose values would be read from the GPU


class UNetPaths(Protocol):
    depth: int

    def inspect(self, args: tuple, kwargs: dict) -> CallInfo:
        """Read a call made with the UNet's own forward signature (does not run anything heavy or mutate inputs)."""

    def full_forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The full UNet, exactly as its own forward computes it; returns (output, feature at the cache point)."""

    def shallow_forward(self, cached: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Only the outer `depth` skip branches, with `cached` standing in for the skipped deep part."""

    def native_forward(self, *args, **kwargs) -> Any:
        """The UNet's own (class) forward, for calls the paths cannot serve."""

    def reference_forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The UNet's own forward, eager, without side effects on the caller's inputs: to verify full_forward."""
