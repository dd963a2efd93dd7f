"""Model families as plug-ins: what the core needs to know about a diffusion model's repeated blocks.

One small module per family declares, with `register(Family(...))` per class layout, its block stacks (the
`nn.ModuleList`s of identical blocks, in the order the model runs them, and per stack which block arguments carry the
hidden states and in what order a block returns them), its display name, the layers quantization leaves in float, its
host-sync fixes, its static-shape and sequence-split rules and its built-in test models (family.py). Compile Model
compiles each distinct block once from this (regional compilation), and the step cache cuts between blocks with it.
Adding a family is one file here and its import line below; a diffusers class of the family is one more Family in that
file (`DIFFUSERS` in flux, wan, sd3, zimage, ltxv; Flux.2's and Chroma's in flux), unless ComfyUI's class has diffusers'
name and layout (Qwen-Image's).
"""
from .family import (_DECLINED, _ORIGINALS, FAMILIES, BlockStack, Family, HostSyncFix, family_of,  # noqa: F401
                     family_titles, register, registered)
from . import flux, qwen_image, sd3, wan, zimage, ltxv  # noqa: E402,F401,I001  (each registers its families)
