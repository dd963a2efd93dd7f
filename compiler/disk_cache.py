"""Compiled artifacts on disk, keyed so that an engine tuned on one GPU model or software stack is never reused
on another (storage.cache_key). Payload: Inductor's own cache artifacts (FX graphs, AOTAutograd entries, autotuning
results) from `torch.compiler.save_cache_artifacts()`, which a new process hot-loads before its first compile.
Files are framed and written atomically by `storage`; a truncated or corrupt file is logged, deleted and rebuilt,
never a crash. The folder comes from the caller's CompileOptions.cache_dir.
"""
import functools
import logging
import os
import pathlib
import threading

import torch

from ..storage import cache_dir, cache_key, discard, read_framed, write_framed

log = logging.getLogger("overdrive.compiler")
_lock = threading.Lock()


def compile_key(fingerprint: str, options: dict, device) -> str:
    return cache_key({"fingerprint": fingerprint, "options": options}, device)


def disk_cache_for(directory: str | None):
    """The cache in `directory` (None: $OVERDRIVE_CACHE_DIR/compiled, else ~/.cache/overdrive/compiled), or None
    when OVERDRIVE_DISK_CACHE=0 keeps compiled artifacts in memory only."""
    if os.environ.get("OVERDRIVE_DISK_CACHE", "1") == "0":
        return None
    return _cache_in(str(directory) if directory else str(cache_dir("compiled")))


@functools.lru_cache(maxsize=None)
def _cache_in(directory: str) -> "CompileDiskCache":
    return CompileDiskCache(directory)


class CompileDiskCache:
    """`load(key)` before the first compile of a graph, `save(key)` after it compiled something new."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)

    def path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.bin"

    def load(self, key: str) -> bool:
        path = self.path(key)
        if not path.is_file():
            return False
        try:
            payload = read_framed(path)
            with _lock:
                torch.compiler.load_cache_artifacts(payload)
        except Exception as error:  # noqa: BLE001 - a bad cache entry must never stop a generation
            log.warning("Overdrive: discarding the compile cache entry %s (%s); it will be rebuilt.", path, error)
            discard(path)
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
        write_framed(path, payload)
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
