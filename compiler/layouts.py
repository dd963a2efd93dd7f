"""Convolution weights converted once, in place, to the channels-last layout that cuDNN and Inductor run fastest."""
import torch

FORMATS = {torch.nn.Conv2d: torch.channels_last, torch.nn.Conv3d: torch.channels_last_3d}


def conv_weights_channels_last_(module: torch.nn.Module, conv_class=torch.nn.Conv2d) -> int:
    """Every `conv_class` weight under `module` in its channels-last layout, in place (values unchanged, as Module.to
    does it); returns how many."""
    convs = [m for m in module.modules() if isinstance(m, conv_class)]
    for conv in convs:
        conv.weight.data = conv.weight.data.to(memory_format=FORMATS[conv_class])
    return len(convs)
