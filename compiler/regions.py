"""Regional compilation: a model's repeated transformer blocks are compiled once per shape and reused.

SDXL's UNet holds 70 transformer blocks of two widths. Compiled as one flat graph, AOTAutograd and Inductor lower,
schedule and generate code for every one of them: most of a two-minute cold compile on an H100. Each block's
forward is instead called through `torch.compiler.nested_compile_region`: Dynamo still sees every call, but
identical block graphs become one subgraph that AOTAutograd and Inductor compile once and the outer graph calls
(still one graph, one CUDA graph per step). Outside torch.compile the region is a plain call.

ComfyUI's blocks take `transformer_options`, whose per-block entries ("block", "block_index") would make every
block's traced graph different. Blocks only read them to look up patches, so a block whose options hold no patch it
would apply runs in the region without them (or with Overdrive's own attention override alone); a block that has
such a patch (IP-Adapter's attention patches, another node's attention override) runs inline with its options,
exactly as without regions.
"""
import inspect
import types

import torch

# Classes whose instances are repeated, structurally identical blocks: ComfyUI's and diffusers' transformer blocks.
REPEATED_BLOCK_CLASSES = frozenset({"BasicTransformerBlock"})

# ComfyUI transformer_options entries that change what a BasicTransformerBlock computes.
BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "middle_patch", "attn2_patch", "attn2_output_patch")
BLOCK_REPLACES = ("attn1", "attn2")
ATTENTION_OVERRIDE = "optimized_attention_override"


def block_transformer_options(options):
    """What a compiled block is given of ComfyUI's transformer_options: {} (nothing), {override} when the only thing
    that applies is Overdrive's own attention (the same object for every block, so blocks still share one graph),
    or None when a patch or another node's attention override needs the block to see all of them."""
    if not options:
        return {}
    patches = options.get("patches") or {}
    replaces = options.get("patches_replace") or {}
    if any(patches.get(key) for key in BLOCK_PATCHES) or any(replaces.get(key) for key in BLOCK_REPLACES):
        return None
    override = options.get(ATTENTION_OVERRIDE)
    if override is None:
        return {}
    return {ATTENTION_OVERRIDE: override} if getattr(override, "overdrive_attention", False) else None


_nested_region = torch.compiler.nested_compile_region  # a seam for tests that make regions fail
_forwards_by_class: dict = {}


def region_forwards(cls) -> tuple:
    """(forward, ComfyUI forward) to install on blocks of `cls`, made once per class.

    They are bound to each block as methods: Dynamo then sees the block under its own path in the model, which
    torch >= 2.12's region reuse needs to swap in each block's parameters (reached through a helper object's attribute
    instead, every block ran with the first block's weights). The class's own forward is held here rather than read
    as `type(block).forward` inside the region: diffusers registers its blocks with allow_in_graph, and Dynamo
    (torch 2.14) cannot take `.forward` of such a class, so every diffusers region failed."""
    made = _forwards_by_class.get(cls)
    if made is None:
        class_forward = cls.forward

        def run_block(block, *args, **kwargs):
            return class_forward(block, *args, **kwargs)

        region = _nested_region(run_block)

        def region_forward(self, *args, **kwargs):
            return region(self, *args, **kwargs)

        def comfy_region_forward(self, x, context=None, transformer_options=None):
            shared = block_transformer_options(transformer_options)
            if shared is None:
                return run_block(self, x, context, transformer_options)
            return region(self, x, context, shared) if shared else region(self, x, context)

        region_forward.overdrive_region = comfy_region_forward.overdrive_region = True
        made = _forwards_by_class[cls] = (region_forward, comfy_region_forward)
    return made


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every repeated transformer block in `module`."""
    return [sub for sub in module.modules() if type(sub).__name__ in REPEATED_BLOCK_CLASSES]


def has_region(block: torch.nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and getattr(forward.__func__, "overdrive_region", False)


def install_regions(module: torch.nn.Module) -> int:
    """Route the repeated blocks' forwards through compile regions, in place; returns how many blocks."""
    blocks = repeated_blocks(module)
    for block in blocks:
        if not has_region(block):
            # ComfyUI's blocks take forward(x, context=None, transformer_options={}); diffusers' take no options.
            takes_options = "transformer_options" in inspect.signature(type(block).forward).parameters
            plain, comfy = region_forwards(type(block))
            block.forward = types.MethodType(comfy if takes_options else plain, block)
    return len(blocks)


def uninstall_regions(module: torch.nn.Module) -> None:
    for block in repeated_blocks(module):
        if has_region(block):
            del block.forward
