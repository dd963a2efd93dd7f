"""Regional compilation: a model's repeated transformer blocks are compiled once per shape and reused.

SDXL's UNet holds 70 transformer blocks of two widths. Compiled as one flat graph, AOTAutograd and Inductor lower,
schedule and generate code for every one of them: most of a two-minute cold compile on an H100. Each block's
forward is instead called through `torch.compiler.nested_compile_region`: Dynamo still sees every call, but
identical block graphs become one subgraph that AOTAutograd and Inductor compile once and the outer graph calls
(still one graph, one CUDA graph per step). Outside torch.compile the region is a plain call.

A front end's blocks may take per-call options (ComfyUI's `transformer_options`), whose per-block entries would make
every block's traced graph different. Blocks only read them to look up patches, so a block is given in the region
what the front end's description says a shared block may see (core/call_options.py); a call whose options hold a patch
it would apply (IP-Adapter's attention patches, another node's attention override) runs inline with its options,
exactly as without regions.
"""
import inspect
import types

import torch

from ..core.call_options import NO_CALL_OPTIONS, CallOptions

# Classes whose instances are repeated, structurally identical blocks: ComfyUI's and diffusers' transformer blocks.
REPEATED_BLOCK_CLASSES = frozenset({"BasicTransformerBlock"})


_nested_region = torch.compiler.nested_compile_region  # a seam for tests that make regions fail
_forwards_by_class: dict = {}


def region_forwards(cls, described: CallOptions) -> tuple:
    """(forward, forward that takes the front end's options) to install on blocks of `cls`, made once per class and
    front end (`described`: its per-call options).

    They are bound to each block as methods: Dynamo then sees the block under its own path in the model, which
    torch >= 2.12's region reuse needs to swap in each block's parameters (reached through a helper object's attribute
    instead, every block ran with the first block's weights). The class's own forward is held here rather than read
    as `type(block).forward` inside the region: diffusers registers its blocks with allow_in_graph, and Dynamo
    (torch 2.14) cannot take `.forward` of such a class, so every diffusers region failed."""
    made = _forwards_by_class.get((cls, described))
    if made is None:
        class_forward = cls.forward

        def run_block(block, *args, **kwargs):
            return class_forward(block, *args, **kwargs)

        region = _nested_region(run_block)

        def region_forward(self, *args, **kwargs):
            return region(self, *args, **kwargs)

        def options_region_forward(self, *args, **kwargs):
            options = described
            shared = options.shared(kwargs.get(options.keyword))
            if shared is None:
                return run_block(self, *args, **kwargs)
            kwargs = options.without(kwargs)
            if shared:
                kwargs[options.keyword] = shared
            return region(self, *args, **kwargs)

        region_forward.overdrive_region = options_region_forward.overdrive_region = True
        made = _forwards_by_class[cls, described] = (region_forward, options_region_forward)
    return made


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every repeated transformer block in `module`."""
    return [sub for sub in module.modules() if type(sub).__name__ in REPEATED_BLOCK_CLASSES]


def has_region(block: torch.nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and getattr(forward.__func__, "overdrive_region", False)


def install_regions(module: torch.nn.Module, described: CallOptions = NO_CALL_OPTIONS) -> int:
    """Route the repeated blocks' forwards through compile regions, in place; returns how many blocks. `described`:
    the front end's per-call options."""
    blocks = repeated_blocks(module)
    for block in blocks:
        if not has_region(block):
            # ComfyUI's blocks take forward(x, context=None, transformer_options={}); diffusers' take no options.
            keyword = described.keyword
            takes_options = keyword is not None and keyword in inspect.signature(type(block).forward).parameters
            plain, with_options = region_forwards(type(block), described)
            block.forward = types.MethodType(with_options if takes_options else plain, block)
    return len(blocks)


def uninstall_regions(module: torch.nn.Module) -> None:
    for block in repeated_blocks(module):
        if has_region(block):
            del block.forward
