"""ComfyUI's `transformer_options`, described for the core (core/call_options.py): which entries a block compiled once for
every block may see, where a step's sigmas are, which patches change what a model computes, and which entries no
forward reads."""
import types

from ..core.call_options import CallOptions

KEYWORD = "transformer_options"
# Entries that change what a block (BasicTransformerBlock, a DiT block) computes: attention patches and replacements.
BLOCK_PATCHES = ("attn1_patch", "attn1_output_patch", "middle_patch", "attn2_patch", "attn2_output_patch")
BLOCK_REPLACES = ("attn1", "attn2")
# ComfyUI's seam for attention (comfy_host/attention_override.py installs Overdrive's there).
ATTENTION_OVERRIDE = "optimized_attention_override"
# Sequence parallelism's mark on a block's options (comfy_host/sequence_split.py): (text tokens, image tokens) of this
# process's block inputs, which its attention override reads; the same for every block of a call.
SEQUENCE_SHARD = "overdrive_sequence_shard"
# A video model's token grid (frames, height, width), which ComfyUI's Wan code sets: Sparse Video Attention's override
# reads it.
VIDEO_GRID = "grid_sizes"
# ComfyUI copies a ModelPatcher's callbacks here while it samples. They run when the model loads, detaches or is
# cleaned up (QuantizeModel's device follower, Compile Model's frame release), never in the forward.
LIFECYCLE_CALLBACKS = "callbacks"
# Its wrappers too: a diffusion model's forward runs only the "diffusion_model" ones (WrappersMP.DIFFUSION_MODEL), the
# sampler the others around it (sampler_sample: Overdrive's conds_on_device).
WRAPPERS, FORWARD_WRAPPERS = "wrappers", "diffusion_model"


def shared_block_options(options):
    """What a compiled block is given of a call's transformer_options: {} (nothing), {override} when the only thing
    that applies is Overdrive's own attention (the same object for every block, so blocks still share one graph; with
    sequence parallelism's mark, the same for every block too), or None when a patch or another node's attention
    override needs the block to see all of them. Its per-block entries ("block", "block_index") would make every
    block's traced graph different."""
    if not options:
        return {}
    patches = options.get("patches") or {}
    replaces = options.get("patches_replace") or {}
    if any(patches.get(key) for key in BLOCK_PATCHES) or any(replaces.get(key) for key in BLOCK_REPLACES):
        return None
    shared = {SEQUENCE_SHARD: options[SEQUENCE_SHARD]} if SEQUENCE_SHARD in options else {}
    override = options.get(ATTENTION_OVERRIDE)
    if override is None:
        return shared
    if not getattr(override, "overdrive_attention", False):
        return None
    if video_sparsity_of(override) is not None and VIDEO_GRID in options:  # the same grid for every block of a call
        shared[VIDEO_GRID] = options[VIDEO_GRID]
    return {ATTENTION_OVERRIDE: override, **shared}


def video_sparsity_of(override):
    """The Sparse Video Attention settings an attention override carries, or None (sequence parallelism's override
    carries no settings)."""
    return getattr(getattr(override, "config", None), "video", None)


def step_sigmas(options):
    """ComfyUI gives every call of a sampling step the same sigmas tensor, and a new one at the next step."""
    return options.get("sigmas") if options else None


def active_patches(options) -> tuple:
    options = options or {}
    patches = tuple(sorted(k for k, v in (options.get("patches") or {}).items() if v))
    replaces = tuple(sorted(k for k, v in (options.get("patches_replace") or {}).items() if v))
    return patches, replaces


def forward_wrappers(wrappers):
    return {kind: value for kind, value in wrappers.items() if kind == FORWARD_WRAPPERS} \
        if isinstance(wrappers, dict) else wrappers


COMFY_CALL_OPTIONS = CallOptions(keyword=KEYWORD, shared=shared_block_options, step_sigmas=step_sigmas,
                                 patches=active_patches,
                                 inert=types.MappingProxyType({LIFECYCLE_CALLBACKS: None, WRAPPERS: forward_wrappers}))
