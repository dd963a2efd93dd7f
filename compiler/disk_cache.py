"""Compiled artifacts on disk, keyed so that an engine tuned on one GPU model or software stack is never reused
on another. Payload: Inductor's own cache artifacts (FX graphs, AOTAutograd entries, autotuning results) from
`torch.compiler.save_cache_artifacts()`, which a new process hot-loads before its first compile.

File format: 8-byte magic, 32-byte sha256 of the payload, payload. Writes are atomic (temp file + rename);
a truncated or corrupt file is logged, deleted and rebuilt, never a crash.
"""
import hashlib
import json
import logging
import os
import pathlib
import platform
import tempfile
import threading

import torch

from ..cache_dirs import cache_dir

log = logging.getLogger("overdrive.compiler")
MAGIC = b"OVDRV001"
_lock = threading.Lock()


def default_cache_dir() -> pathlib.Path:
    return cache_dir("compiled")


def device_identity(device: torch.device) -> dict:
    """What a compiled/tuned kernel depends on besides the model: the exact GPU model and the software stack."""
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


def cache_key(fingerprint: str, options: dict, device: torch.device) -> str:
    payload = json.dumps({"fingerprint": fingerprint, "options": options, "device": device_identity(device)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def read_checked(path: pathlib.Path) -> bytes:
    """The payload of a file written by `write_atomic`; ValueError if it is truncated or corrupt."""
    data = path.read_bytes()
    if data[:8] != MAGIC or hashlib.sha256(data[40:]).digest() != data[8:40]:
        raise ValueError("bad header or checksum (truncated or corrupt file)")
    return data[40:]


def write_atomic(path: pathlib.Path, payload: bytes) -> None:
    """MAGIC + sha256 + payload to `path`, through a temp file and a rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


class CompileDiskCache:
    """`load(key)` before the first compile of a graph, `save(key)` after it compiled something new."""

    def __init__(self, directory=None):
        self.directory = pathlib.Path(directory) if directory else default_cache_dir()

    def path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.bin"

    def load(self, key: str) -> bool:
        path = self.path(key)
        if not path.is_file():
            return False
        try:
            payload = read_checked(path)
            with _lock:
                torch.compiler.load_cache_artifacts(payload)
        except Exception as error:  # noqa: BLE001 - a bad cache entry must never stop a generation
            log.warning("Overdrive: discarding the compile cache entry %s (%s); it will be rebuilt.", path, error)
            path.unlink(missing_ok=True)
            return False
        log.info("Overdrive: loaded compiled artifacts from %s (%.1f MB)", path, (len(payload) + 40) / 1e6)
        return True

    def save(self, key: str) -> pathlib.Path | None:
        with _lock:
            artifacts = torch.compiler.save_cache_artifacts()
        if not artifacts:
            return None
        payload = artifacts[0]
        path = self.path(key)
        write_atomic(path, payload)
        log.info("Overdrive: saved compiled artifacts to %s (%.1f MB)", path, (len(payload) + 40) / 1e6)
        return path

    def frames_dir(self, key: str) -> pathlib.Path:
        """Where the precompiled frames of entry `key` live (compiler/precompiled.py)."""
        return self.directory / f"{key}.frames"

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.rglob("*.bin")) if self.directory.is_dir() else 0

    def clear(self) -> int:
        removed = 0
        for p in self.directory.rglob("*.bin") if self.directory.is_dir() else []:
            p.unlink(missing_ok=True)
            removed += 1
        return removed
