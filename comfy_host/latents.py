"""A LATENT's samples as tensors: ComfyUI packs LTX-2's video and audio latents (LTXVConcatAVLatent) into a
`comfy.nested_tensor.NestedTensor`, which is not a torch.Tensor; every other latent is one tensor."""
import torch


def latent_parts(samples) -> list:
    """The tensors of a LATENT's samples: itself, or the parts of a nested latent (video first, then audio)."""
    if not isinstance(samples, torch.Tensor) and getattr(samples, "is_nested", False) and hasattr(samples, "unbind"):
        return list(samples.unbind())
    return [samples]
