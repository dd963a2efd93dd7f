"""A layer's tensors, read from its modules' tensor dicts."""


def tensors_of(module) -> list:
    """(submodule, "_parameters" | "_buffers", name, tensor) for every tensor in `module`'s tree: read from the tensor
    dicts, not state_dict() (its cost per layer, at every load, adds up over a model's hundreds of layers). A 1x1 conv's
    8-bit layer holds its tensors in its inner GEMM."""
    return [(sub, kind, name, tensor) for sub in module.modules() for kind in ("_parameters", "_buffers")
            for name, tensor in getattr(sub, kind).items() if tensor is not None]


def tensor_bytes(module) -> int:
    return sum(tensor.numel() * tensor.element_size() for *_, tensor in tensors_of(module))
