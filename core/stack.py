"""One accelerated diffusion-model forward: which of Overdrive's accelerators run it (a `Stack`) and the one place
that builds the callable from them (`build`).

The ComfyUI nodes and the diffusers API never look at each other's objects: they read the Stack of the forward that
is installed (`stack_of`), extend it (`with_compile`, `with_cache`) and `build` it over their module through a `Host`,
the few things a front end supplies (how it compiles a method, its UNet's step-cache runner, its sampling clock).
Quantization and weight switching change the module's layers or weights; they rebuild the same Stack over the result,
so compiled graphs are keyed by the new layers and shared again by every checkpoint of the architecture.

Composition order, decided here only:
- a family with a plug-in (families/: the DiTs) runs one BlockwiseForward holding its compiled blocks and its step
  cache, so both cache paths reuse the same compiled blocks;
- a UNet with a step cache runs a DeepCacheRunner whose native forward and both paths are compiled;
- a UNet without one runs a compiled forward;
- a split over processes (the diffusers API's parallelize_) wraps that, and attention routing wraps everything.
"""
from __future__ import annotations

import dataclasses

from ..attention.choice import AttentionConfig
from ..attention.routing import RoutedForward, unwrapped
from .blockwise import BlockwiseForward
from .call_options import NO_CALL_OPTIONS
from ..compiler import CompiledMethod, CompileOptions
from ..step_cache import DeepCacheConfig
from ..families import family_of
from ..parallel.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class Stack:
    """compile: CompileOptions (None: eager). cache_config: the step cache's DeepCacheConfig (None: every step full).
    attention: where the forward's SDPA calls go (AttentionConfig; None: torch's SDPA). ComfyUI's nodes route attention
    through ComfyUI's own override instead (comfy_host/attention_override.py).
    parallel: how each call splits over the processes of the torch.distributed group (ParallelConfig; None: whole in
    this one). The diffusers API only: ComfyUI's Parallel Model splits calls in ComfyUI's own wrapper."""

    compile: CompileOptions | None = None
    cache_config: DeepCacheConfig | None = None
    attention: AttentionConfig | None = None
    parallel: ParallelConfig | None = None

    def with_compile(self, options: CompileOptions | None) -> "Stack":
        return dataclasses.replace(self, compile=options)

    def with_cache_config(self, config: DeepCacheConfig | None) -> "Stack":
        return dataclasses.replace(self, cache_config=config)

    def with_attention(self, config: AttentionConfig | None) -> "Stack":
        return dataclasses.replace(self, attention=config)

    def with_parallel(self, config: ParallelConfig | None) -> "Stack":
        return dataclasses.replace(self, parallel=config)

    @property
    def empty(self) -> bool:
        return self.compile is None and self.cache_config is None and self.attention is None and self.parallel is None


def stack_of(forward) -> Stack | None:
    """The Stack a forward was built from; None for no forward or another extension's."""
    return getattr(forward, "overdrive_stack", None)


class Host:
    """What a front end supplies to `build` over `module`. Subclasses: comfy_host/forward_patch.ComfyHost,
    diffusers_api/installed.DiffusersHost."""

    # How the front end hands per-call options to the model and its blocks (core/call_options.py): everything built
    # here carries it, so two front ends in one process each route their own.
    call_options = NO_CALL_OPTIONS

    def __init__(self, module):
        self.module = module

    def compiled(self, module, method: str, options: CompileOptions, block_path: str = "") -> CompiledMethod:
        """`module.<method>` compiled; `block_path` names a block of a blockwise forward."""
        return CompiledMethod(module, method, self.with_call_options(options), announce=not block_path)

    def with_call_options(self, options: CompileOptions) -> CompileOptions:
        return dataclasses.replace(options, call_options=self.call_options)

    def family(self):
        return family_of(self.module)

    def block_graphs(self):
        """The BlockGraphs for a blockwise forward over this module (None: a new one). A host that rebuilds the
        forward over the same layers (ComfyUI's nodes, at each run of the node chain) gives the one it had, so its
        recordings replay instead of being recorded again."""
        return None

    def unet_runner(self, config: DeepCacheConfig, native):
        """A DeepCacheRunner over this UNet running `native` on full steps (None: the UNet's own forward).
        Raises deepcache.UnsupportedUNetError for a UNet layout it does not know."""
        raise NotImplementedError

    def eager_forward(self):
        """The forward a step cache calls on full steps when nothing is compiled (None: the module's own)."""
        return None

    def percent_to_sigma(self, percent: float) -> float:
        raise NotImplementedError

    def split(self, inner, config: ParallelConfig):
        """`inner` (None: the module's own forward) run over the processes of the group, by `config`."""
        raise NotImplementedError

    # A resolved DeepCacheConfig -> the calibrated step decisions shared by the forwards built for this module and
    # settings (None: each step cache keeps its own).
    learned_steps = None

    # (args, kwargs) of a model call -> a function giving (sigma, run key, branch, why not cacheable) when a DiT's
    # step cache decides (comfy_host/comfy_steps.py, diffusers_api/steps.py); a host whose DiTs take a step cache sets it.
    read_step = None


def build(stack: Stack, host: Host, keep=None):
    """The forward that runs `host.module` with `stack` (None for an empty stack). `keep`: a forward built before
    with the same step-cache settings whose runner object should be updated rather than replaced (the diffusers API
    hands runners to its callers; their statistics stay live). Attention routing wraps whatever runs the model."""
    if stack.empty:
        return None
    family = host.family()
    for fix in family.host_sync_fixes if family is not None else ():
        fix.install()
    inner = _build(stack.with_attention(None).with_parallel(None), host, unwrapped(keep))
    if stack.parallel is not None:  # inside the attention routing: the split's own SDPA calls are routed
        inner = host.split(inner, stack.parallel)
        inner.overdrive_stack = stack.with_attention(None)
    if stack.attention is None:
        return inner
    forward = RoutedForward(host.module, inner, stack.attention)
    forward.overdrive_stack = stack
    return forward


def _build(stack: Stack, host: Host, keep):
    if stack.empty:
        return None
    family = host.family()
    if family is not None:
        previous = stack_of(keep)
        kept = keep.step_cache if previous is not None and previous.cache_config == stack.cache_config and stack.cache_config is not None \
            and isinstance(keep, BlockwiseForward) else None
        forward = BlockwiseForward(host.module, family, stack.compile, stack.cache_config,
                                   lambda block, path, options: host.compiled(block, "forward", options, path),
                                   percent_to_sigma=host.percent_to_sigma, read_step=host.read_step, step_cache=kept,
                                   graphs=host.block_graphs() if stack.compile is not None else None,
                                   call_options=host.call_options, learned_steps=host.learned_steps)
    elif stack.cache_config is None:
        forward = host.compiled(host.module, "forward", stack.compile)
    else:
        native = host.compiled(host.module, "forward", stack.compile) if stack.compile is not None \
            else host.eager_forward()
        previous = stack_of(keep)
        forward = keep if previous is not None and previous.cache_config == stack.cache_config else host.unet_runner(stack.cache_config,
                                                                                                      native)
        if stack.compile is not None:
            paths = {name: host.compiled(forward.paths, name, stack.compile)
                     for name in ("full_forward", "shallow_forward")}
        else:
            paths = {name: getattr(forward.paths, name) for name in ("full_forward", "shallow_forward")}
        # Everything is built before the runner changes: a failure above leaves `keep` as it was.
        forward.native = native if native is not None else forward.paths.native_forward
        forward.full_path, forward.shallow_path = paths["full_forward"], paths["shallow_forward"]
    forward.overdrive_stack = stack
    return forward
