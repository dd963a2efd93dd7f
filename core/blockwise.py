"""The forward of a diffusion model whose family is known (families/): the model's own code, with every block of its
stacks called through one compiled graph per distinct block and, optionally, the DiT step cache.

Why blocks and not one whole-model graph for DiTs: a DiT step is GPU-bound (Flux.1 at 1024² runs near the tensor
cores' rate compiled), so the whole-model graph's fusions across block boundaries and its CUDA graph gain little,
while compiling every block inline dominated a long cold compile. Compiled per block, Flux traces and lowers two
graphs (a double and a single block) that every block of that shape runs, and the step cache decides between blocks
in plain Python, outside any graph, so both its paths reuse the same compiled blocks.

While a call runs, each block's `forward` is this object's per-block callable (an instance attribute, restored
after the call), so the model's own forward, ComfyUI's block-replace patches and its ControlNet code run unchanged.
"""
import dataclasses
import functools
import logging
import weakref

from .call_options import NO_CALL_OPTIONS
from ..compiler import CompiledMethod
from ..compiler.block_graphs import BlockGraphs
from ..step_cache.block_cache import BlockStepCache
from ..step_cache.runner import DeepCacheUnsupportedError

log = logging.getLogger("overdrive")


def block_options(options):
    """Compile options for one block: no Inductor CUDA graph (the blocks' own recordings are BlockwiseForward's,
    compiler/block_graphs.py), no nested regions, tanh-GELU traced in its fast form (compiler/activations.py). Every
    shape of the first sampling step specialised and, with precompile, saved whole (the token layouts of a step:
    Z-Image's refiners and main layers, Wan's cond and uncond context lengths), so a restart loads every block it runs
    without tracing it; a later resolution follows `dynamic`."""
    return dataclasses.replace(options, cuda_graphs=False, regional=False, static_shapes="first_step",
                               fast_activations=True)


def _run_block_of(forward_ref, *args, **kwargs):
    return forward_ref()._run_block(*args, **kwargs)


class BlockwiseForward:
    """`diffusion_model.forward` for a model of a known family.

    module:  the diffusion model.
    family:  its families.Family.
    options: CompileOptions to compile each distinct block once (None: blocks run eager).
    cache_config: a DeepCacheConfig for the step cache (None: every step runs every block).
    compiled_block: factory (block, path, options) -> CompiledMethod; the ComfyUI adapter passes one that keys each
             block by the layers a load swaps into it.
    percent_to_sigma: the cache window's sigmas (ComfyUI: model_sampling.percent_to_sigma).
    read_step: (args, kwargs) of a model call -> a function returning (sigma, run key, branch, why it cannot be cached
             or None), called when the step cache must decide; needed with `cache_config` (the front end's: ComfyUI's
             comfy_host/comfy_steps.py, diffusers_api/steps.py).
    step_cache: a BlockStepCache of the same config to carry on (its statistics stay live for whoever holds it).
    learned_steps: config -> the dict of calibrated step decisions a new step cache shares (the host's, kept per model
             and settings), or None for its own.
    graphs:  the BlockGraphs of a forward built before over the same layers, to replay its recordings.
    call_options: the front end's per-call options (core/call_options.py), which blocks compiled once are given
             only what they may share of.
    """

    overdrive_stack = None  # set by stack.build

    def __init__(self, module, family, options=None, cache_config=None, compiled_block=None, percent_to_sigma=None,
                 read_step=None, step_cache=None, graphs=None, call_options=NO_CALL_OPTIONS, learned_steps=None):
        if cache_config is not None:
            cache_config = cache_config.for_family(family.step_cache_threshold)
        self.module, self.family, self.options, self.cache_config = module, family, options, cache_config
        self.call_options = call_options
        if cache_config is not None and read_step is None:
            raise ValueError("BlockwiseForward: a step cache needs read_step, how a model call tells its step")
        self.read_step = read_step
        self.blocks = family.blocks(module)
        make = compiled_block or (lambda block, path, opts: CompiledMethod(block, "forward", opts, announce=False))
        if options is not None:
            per_block = block_options(options)
            self.compiled = {path: make(block, path, per_block) for _, path, block in self.blocks}
        else:
            self.compiled = {}
        # The blocks' CUDA graphs (compiler/block_graphs.py): with CompileModel's cuda_graphs, on a CUDA model; those of
        # a forward built before over the same layers where the host keeps them (`graphs`).
        self.graphs = (graphs or BlockGraphs()) if options is not None and options.cuda_graphs else None
        cached = [(block_stack, len(getattr(module, block_stack.attribute))) for block_stack in family.stacks
                  if block_stack.cached]
        learned = learned_steps(cache_config) if learned_steps is not None and cache_config is not None else None
        self.step_cache = step_cache or (BlockStepCache(cache_config, cached, percent_to_sigma, learned)
                                        if cache_config is not None else None)
        # Position among the blocks the step cache sees (the cached stacks', in run order).
        self._cached_position = {path: i for i, path in enumerate(p for block_stack, p, _ in self.blocks if block_stack.cached)}
        # Through a weak reference: the blocks' forwards live in the module's blocks while it runs, and a forward
        # bound to this object (which holds the module) would be a cycle that keeps a dropped model's weights.
        self._block_forwards = [functools.partial(_run_block_of, weakref.ref(self), block_stack, path, block)
                                for block_stack, path, block in self.blocks]
        self._warned = set()
        self._first_step_sigmas = None  # the first sampling step's sigma tensor, until the blocks' shapes are sealed
        self._shapes_sealed = not self.compiled

    # -- the call ----------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not self._shapes_sealed:
            self._seal_shapes_at_a_later_step(kwargs)
        cache = self.step_cache
        if cache is not None:
            cache.begin(functools.partial(self._checked_step, self.read_step(args, kwargs)))
        # Written to the blocks' __dict__ directly: nn.Module.__setattr__ costs more each, twice per block and call,
        # which a reused step (host-bound: one block of GPU work) pays in full.
        saved = [(block.__dict__, block.__dict__.get("forward")) for _, _, block in self.blocks]
        completed = False
        try:
            for (attributes, _), forward in zip(saved, self._block_forwards):
                attributes["forward"] = forward
            out = type(self.module).forward(self.module, *args, **kwargs)
            completed = True
            return out
        finally:
            for attributes, forward in saved:
                if forward is None:
                    attributes.pop("forward", None)
                else:
                    attributes["forward"] = forward
            if cache is not None:
                cache.end(completed)
            if self.graphs is not None:
                self.graphs.forget_copies()
            if not self._shapes_sealed and self._first_step_sigmas is None:
                self._seal_shapes()  # a caller without per-step sigmas: its first call's shapes are the specialised ones

    def _checked_step(self, read):
        sigma, run_key, branch, unsupported = read()
        if unsupported is not None and self.cache_config.on_unsupported == "error":
            raise DeepCacheUnsupportedError(
                f"The step cache cannot run this {type(self.module).__name__} call exactly: {unsupported}. Remove "
                "the step cache, or set on_unsupported='full' to run such calls with every block.")
        if unsupported is not None:
            self._warn_once(f"step cache: {unsupported}; such calls run every block (exact, not accelerated)")
        return sigma, run_key, branch, unsupported

    def _seal_shapes_at_a_later_step(self, kwargs):
        """Blocks specialise every shape of the first sampling step (block_options); at the first call of a later step
        (another sigma tensor: ComfyUI gives one to every call of a step) their graphs take the `dynamic` policy."""
        described = self.call_options
        sigmas = described.step_sigmas(described.of(kwargs))
        if self._first_step_sigmas is None:
            self._first_step_sigmas = sigmas
        elif sigmas is not self._first_step_sigmas:
            self._seal_shapes()

    def _seal_shapes(self):
        for compiled in self.compiled.values():
            compiled.graph.seal_shapes()
        self._shapes_sealed, self._first_step_sigmas = True, None

    def _run_block(self, block_stack, path, block, *args, **kwargs):
        run = functools.partial(self._block_call, block_stack, path, block, args, kwargs)
        position = self._cached_position.get(path)
        if self.step_cache is None or position is None:
            return run()
        return self.step_cache.block(position, args, kwargs, run)

    def _block_call(self, block_stack, path, block, args, kwargs):
        compiled = self.compiled.get(path)
        if compiled is None:
            return type(block).forward(block, *args, **kwargs)
        described = self.call_options
        options = described.of(kwargs)
        shared = described.shared(options)
        if shared is None:
            # Another node's attention override or block patch reads per-block options: such calls run eager, exact.
            self._warn_once("a node patches this model's attention or blocks; those block calls run uncompiled")
            return type(block).forward(block, *args, **kwargs)
        # Blocks only read their options for such patches; per-block entries (ComfyUI's block_index) would make every
        # block's graph different. What a shared block may see (Overdrive's own attention override) is passed alone.
        kwargs = described.without(kwargs)
        if described.keyword and (shared or block_stack.options):
            kwargs[described.keyword] = {**shared, **{k: options[k] for k in block_stack.options if k in options}}
        if self.graphs is not None:
            return self.graphs.call(path, block, block_stack, compiled, args, kwargs)
        return compiled(*args, **kwargs)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("Overdrive %s: %s", type(self.module).__name__, message)

    def reset(self, new_weights: bool = False) -> None:
        """End the step cache's run (as a DeepCacheRunner's reset does): no residual is reused after it, and after
        `new_weights` no calibrated decision either."""
        if self.step_cache is not None:
            self.step_cache.reset(new_weights)

    def release_graphs(self) -> None:
        """Free the blocks' CUDA graphs and their buffers (ComfyUI unloads the model); the next calls record again."""
        if self.graphs is not None:
            self.graphs.release()

    def describe(self) -> str:
        parts = []
        if self.options is not None:
            distinct = len({c.fingerprint for c in self.compiled.values()})
            parts.append(f"{len(self.compiled)} blocks compiled as {distinct} distinct graph(s)")
        if self.graphs is not None and self.graphs.recorded:
            parts.append(self.graphs.describe())
        if self.step_cache is not None:
            parts.append(f"step cache ({self.cache_config.describe()})")
        return ", ".join(parts) or "eager"
