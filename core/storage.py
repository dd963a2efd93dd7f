"""Every on-disk cache of Overdrive goes through here: one folder rule, one key builder, one atomic writer, one
checksum framing. Nothing happens at import; every folder is passed in by the caller (or read from the environment
at the call).

- `cache_dir(kind, default_root)`: `$OVERDRIVE_CACHE_DIR/<kind>`, else `<default_root>/<kind>` (ComfyUI: beside its
  models), else `~/.cache/overdrive/<kind>`.
- `cache_key(parts, device)`: a hex digest of the caller's parts plus what compiled or tuned code depends on besides
  the model: the exact GPU model, its compute capability and the software versions (`device_identity`). A kernel
  tuned on one GPU or stack is never reused on another (an engine built on an H100 PCIe ran ~3 % slower on an SXM5).
- `atomic_file(path)`: write a temporary file in the same folder and rename it over `path` when complete, so
  readers (another ComfyUI worker sharing the folder) never see half a file.
- `write_framed` / `read_framed`: magic + sha256 + payload; a truncated or edited file reads as `CorruptEntry`,
  which callers log, delete and rebuild. Large files written by another library (safetensors) keep their
  `file_sha256` inside a framed entry.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import platform
import tempfile

import torch

from .errors import OverdriveError

MAGIC = b"OVDRV001"
_HEADER = len(MAGIC) + 32


class CorruptEntry(OverdriveError, ValueError):
    """A cache file that is truncated, edited or of another format."""


def cache_dir(kind: str, default_root=None) -> pathlib.Path:
    """Read at each call, so a changed environment takes effect."""
    root = os.environ.get("OVERDRIVE_CACHE_DIR") or default_root or pathlib.Path.home() / ".cache" / "overdrive"
    return pathlib.Path(root) / kind


def device_identity(device) -> dict:
    """The exact GPU model, compute capability and software stack a compiled or measured kernel depends on."""
    device = torch.device(device)
    identity = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        identity.update(gpu=torch.cuda.get_device_name(index), capability=list(torch.cuda.get_device_capability(index)),
                        cuda=torch.version.cuda)
        try:
            import triton
            identity["triton"] = triton.__version__
        except ImportError:
            identity["triton"] = None
    else:
        identity.update(gpu=None, cpu=platform.machine(), processor=platform.processor())
    return identity


def cache_key(parts: dict, device, length: int = 24) -> str:
    """sha256 over `parts` (JSON-serialisable) and the device identity, as `length` hex digits."""
    payload = json.dumps({**parts, "device": device_identity(device)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:length]


@contextlib.contextmanager
def atomic_file(path: pathlib.Path):
    """Yields a temporary path beside `path`; once the block completes, the file is synced and renamed over `path`.
    On any error (or an interrupt) the temporary file is removed and `path` is left as it was."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield pathlib.Path(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


def write_framed(path: pathlib.Path, payload: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)


def read_framed(path: pathlib.Path) -> bytes:
    """The payload of a file written by `write_framed`; CorruptEntry if it is truncated, edited or foreign."""
    data = pathlib.Path(path).read_bytes()
    if data[:len(MAGIC)] != MAGIC or hashlib.sha256(data[_HEADER:]).digest() != data[len(MAGIC):_HEADER]:
        raise CorruptEntry("bad header or checksum (truncated or corrupt file)")
    return data[_HEADER:]


def write_framed_json(path: pathlib.Path, entry: dict) -> None:
    write_framed(path, json.dumps(entry, sort_keys=True, indent=1).encode())


def read_framed_json(path: pathlib.Path) -> dict:
    try:
        entry = json.loads(read_framed(path))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptEntry(str(error)) from error
    if not isinstance(entry, dict):
        raise CorruptEntry("not a JSON object")
    return entry


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def discard(path: pathlib.Path) -> None:
    """Delete a bad entry; a folder we cannot write only means it is rebuilt in memory each time."""
    try:
        pathlib.Path(path).unlink(missing_ok=True)
    except OSError:
        pass
