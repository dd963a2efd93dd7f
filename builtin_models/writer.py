"""A streaming .safetensors writer: the header is known from the shapes alone, so each tensor can be made,
written and dropped in turn. safetensors.torch.save_file needs them all in memory at once (7 GB for a
full SDXL checkpoint). Format: u64 little-endian header length, JSON header, then the raw bytes."""
import json
import math
import pathlib
from typing import Callable, Dict, Sequence, Tuple

import torch

from ..core.storage import atomic_file

DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def write_safetensors(path: pathlib.Path, shapes: Sequence[Tuple[str, Tuple[int, ...]]], dtype: torch.dtype,
                      make: Callable[[str], torch.Tensor], metadata: Dict[str, str]) -> None:
    """Writes tensors `make(key)` in the order of `shapes`; the temporary file replaces `path` only when
    complete (storage.atomic_file): readers never see a half-written checkpoint."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": metadata}, 0
    for key, shape in shapes:
        size = math.prod(shape) * itemsize
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned, as safetensors writes it

    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for key, shape in shapes:
            tensor = make(key)
            assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape), key
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # little-endian, as required
