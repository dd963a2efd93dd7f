"""Which weights a UNet runs with, as a cheap token: cached features are never reused across weight changes."""
import torch.nn as nn


def weights_token(module: nn.Module) -> int:
    """Changes when a submodule or a Parameter object is replaced (ComfyUI applies LoRA and other weight patches by
    installing new Parameters; QuantizeModel swaps modules). Walks the `_modules`/`_parameters` dicts directly: it
    runs at every sampling step, and `module.parameters()` (named traversal) cost ~5 ms per step on SD1.5."""
    ids = []
    stack = [module]
    while stack:
        current = stack.pop()
        ids.append(id(current))
        ids.extend(id(p) for p in current._parameters.values() if p is not None)
        stack.extend(child for child in current._modules.values() if child is not None)
    return hash(tuple(ids))
