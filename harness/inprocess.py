"""A real ComfyUI imported in this process, and full-size or tiny SD1.5/SDXL models built from ComfyUI's own
model classes with fixed-seed random weights (no checkpoint file needed): for benchmarks and in-process tests."""
import sys

import torch

from ..builtin_models.dit import MODULATION, MODULATION_GAIN, layers_with_weights, quiet_build
from ..builtin_models.unet import FULL, unet_config

# What ComfyUI's detection adds beside the shapes in builtin_models.unet (SDXL's label embedding and head size).
EXTRA_CONFIG = {"sd15": {}, "sdxl": dict(num_classes="sequential", num_head_channels=64)}
CONTEXT_DIM = {arch: FULL[arch]["context_dim"] for arch in FULL}


def import_comfy(cpu: bool, dynamic_vram: bool = False, budget_gib: float | None = None, attention: str | None = None):
    """ComfyUI's modules in this process, set up as `main.py --cpu` (`cpu`) or on the GPU; `dynamic_vram`: with dynamic
    VRAM as main.py turns it on by default on NVIDIA GPUs (else as with --disable-dynamic-vram); `budget_gib`: a card
    of that many GiB emulated on a larger one (`reserve_beyond_budget`); `attention` "sage" or "ck": ComfyUI's
    --use-sage-attention or --use-ck-attention (set before its attention module picks its function). Called again in a
    process where dynamic VRAM is on already, it returns ComfyUI as it is (comfy-aimdo starts once a process)."""
    if "comfy.memory_management" in sys.modules and sys.modules["comfy.memory_management"].aimdo_enabled:
        return sys.modules["comfy"]
    from .server import find_comfyui
    path = str(find_comfyui())
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args
    args = comfy.cli_args.args
    fraction = None if budget_gib is None else reserve_beyond_budget(args, budget_gib)
    args.cpu = cpu
    args.use_pytorch_cross_attention = cpu or args.use_pytorch_cross_attention
    args.disable_dynamic_vram = not dynamic_vram
    if attention is not None:
        setattr(args, f"use_{attention}_attention", True)
    if dynamic_vram:  # before ComfyUI's model management touches the GPU, as in main.py
        import comfy_aimdo.control
        comfy_aimdo.control.init(simple_vram_headroom=None if args.reserve_vram is None
                                 else int(args.reserve_vram * 2**30), nvml_pressure=not args.disable_nvml_pressure)
    import comfy.model_management, comfy.sample, comfy.samplers, comfy.supported_models, comfy.model_patcher  # noqa: E401,F401
    if dynamic_vram:
        enable_dynamic_vram()
    if fraction is not None:  # after comfy-aimdo has started, which must come before anything else on the GPU
        torch.cuda.set_per_process_memory_fraction(fraction)
    from .. import nodes  # noqa: F401 - Overdrive's ComfyUI glue, as ComfyUI loads it from custom_nodes
    return sys.modules["comfy"]


def reserve_beyond_budget(args, budget_gib: float) -> float:
    """A card of `budget_gib` GiB emulated on this GPU, as a user's would behave under ComfyUI: ComfyUI reserves the
    rest of the GPU (`--reserve-vram`, set before its model management reads it), and the fraction returned holds
    torch's allocator to the budget, so that what ComfyUI plans and what torch can allocate both end there."""
    if not torch.cuda.is_available():
        raise ValueError(f"budget_gib={budget_gib}: a memory budget is emulated on a CUDA GPU, and there is none here")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30  # the device's properties: no context yet
    if not 0 < budget_gib < total:
        raise ValueError(f"budget_gib={budget_gib}: choose a size between 0 and this GPU's {total:.1f} GiB")
    args.reserve_vram = total - budget_gib
    return budget_gib / total


def enable_dynamic_vram() -> None:
    """ComfyUI's dynamic VRAM on every GPU, as main.py enables it (models loaded from files then get a
    ModelPatcherDynamic). Raises if comfy-aimdo cannot start here."""
    import comfy.cli_args
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy_aimdo.control
    headroom = int(comfy.cli_args.args.vram_headroom * 2**30)
    if not comfy_aimdo.control.init_devices((d.index, headroom) for d in comfy.model_management.get_all_torch_devices()):
        raise RuntimeError("comfy-aimdo did not start on this GPU: ComfyUI would run without dynamic VRAM here")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


@torch.no_grad()
def seeded_init_(module: torch.nn.Module, seed: int, modulation_gain: float = 1.0) -> None:
    """Fan-in scaled normal weights, small biases, norms at 1: finite, non-degenerate outputs at any depth.
    (ComfyUI's layers skip initialisation, so a model built without a checkpoint holds uninitialised memory.)
    Weights of DiT modulation layers (MODULATION) are scaled by `modulation_gain`."""
    generators = {}  # one per device: a model built on the GPU is initialised there (12 B weights in seconds)
    for name, p in module.named_parameters():
        generator = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=generator, device=p.device) * 0.01)
        elif p.ndim <= 1:  # norm weights, CLIP's logit scale
            p.fill_(1.0)
        else:
            gain = modulation_gain if MODULATION.search(name) else 1.0
            p.copy_(torch.randn(p.shape, generator=generator, device=p.device) * gain / max(p[0].numel(), 1) ** 0.5)


# The SD1.x/SDXL autoencoder. Given as an explicit config: ComfyUI builds nothing without weights to detect the
# architecture from.
SD_VAE_CONFIG = {"params": {"embed_dim": 4, "ddconfig": {
    "double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}}}


def build_vae(comfy, seed: int = 0):
    """ComfyUI's own VAE class (the SD/SDXL autoencoder config) with seeded weights."""
    import comfy.sd
    with quiet_build():  # it prints every key it did not get; we fill them just below
        vae = comfy.sd.VAE(sd={}, config=SD_VAE_CONFIG)
    seeded_init_(vae.first_stage_model, seed)
    return vae


def build_model(comfy, arch: str, size: str, dtype: torch.dtype, seed: int = 0):
    """A ModelPatcher around ComfyUI's own SD1.5/SDXL model class, weights N(0, 0.02) from `seed` (norms at 1)."""
    config = dict(use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False,
                  use_temporal_resblock=False, use_temporal_attention=False, **unet_config(arch, size),
                  **EXTRA_CONFIG[arch])
    model_config = {"sd15": comfy.supported_models.SD15, "sdxl": comfy.supported_models.SDXL}[arch](config)
    model_config.set_inference_dtype(dtype, None)
    with layers_with_weights():
        model = model_config.get_model({}, "")
    load_device = comfy.model_management.get_torch_device()
    seeded_init_(model.diffusion_model, seed)
    model.diffusion_model.to(dtype)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=load_device,
                                               offload_device=comfy.model_management.unet_offload_device())
    return patcher


def build_family_vae(comfy, family: str, seed: int = 0):
    """ComfyUI's own VAE class as VAELoader builds it from the family's built-in VAE file (builtin_models.dit),
    the same fixed-seed weights made in memory: no file."""
    import comfy.sd

    from ..builtin_models.dit import FAMILIES, vae_layout
    from ..builtin_models.weights import make_tensor
    state = {s.key: make_tensor(s, seed, torch.float32) for s in vae_layout(FAMILIES[family].vae, "full")}
    return comfy.sd.VAE(sd=state)


def build_dit_model(comfy, family: str, size: str, dtype: torch.dtype, seed: int = 0):
    """A ModelPatcher around ComfyUI's own model class of a DiT family (builtin_models.dit), built and initialised
    on the device it runs on: no file, no copy of 12-20 B weights through host memory."""
    from ..builtin_models.dit import build_model
    load_device = comfy.model_management.get_torch_device()
    model = build_model(family, size, dtype, load_device)
    seeded_init_(model.diffusion_model, seed, MODULATION_GAIN)
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device,
                                            offload_device=comfy.model_management.unet_offload_device())


def save_unet_checkpoint(patcher, path) -> None:
    """`patcher`'s diffusion-model weights as a checkpoint file ComfyUI loads (`model.diffusion_model.*` keys)."""
    from safetensors.torch import save_file
    state = patcher.model.diffusion_model.state_dict()
    save_file({f"model.diffusion_model.{k}": v.contiguous().cpu() for k, v in state.items()}, str(path))


def conditioning(arch: str, width: int, height: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dim = CONTEXT_DIM[arch]
    def one():
        extra = {}
        if arch == "sdxl":
            extra = dict(pooled_output=torch.randn(1, 1280, generator=g), width=width, height=height, crop_w=0, crop_h=0,
                         target_width=width, target_height=height)
        return [[torch.randn(1, 77, dim, generator=g), extra]]
    return one(), one()


def run_node(node_id: str, **inputs):
    """One of Overdrive's nodes run as ComfyUI would: its declared defaults, overridden by `inputs`; its first
    output."""
    from ..nodes import NODES
    cls = NODES[node_id]
    declared = cls.INPUT_TYPES()["required"]
    values = {k: spec[1]["default"] for k, spec in declared.items()
              if len(spec) > 1 and isinstance(spec[1], dict) and "default" in spec[1]}
    return cls.execute(**{**values, **inputs})[0]
