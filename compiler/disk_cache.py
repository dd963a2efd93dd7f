"""Compiled artifacts on disk, keyed so that an engine tuned on one GPU model or software stack is never reused
on another (storage.cache_key). Payload: Inductor's own cache artifacts (FX graphs, AOTAutograd entries, autotuning
results) from `torch.compiler.save_cache_artifacts()`, which a new process hot-loads before its first compile.
Files are framed and written atomically by `storage`; a truncated or corrupt file is logged, deleted and rebuilt,
never a crash. The folder comes from the caller's CompileOptions.cache_dir.

`save_cache_artifacts()` returns what was compiled since its last call, not everything: one entry point that compiles
a second graph (a second resolution; Z-Image's one block class at two token counts) must add it to its entry, or the
entry keeps only the last graph and a restart lowers the others again. An entry is therefore a list of parts.
"""
import functools
import json
import logging
import os
import pathlib
import threading

import torch

from ..core.interrupts import stops_held
from ..core.storage import cache_dir, cache_key, discard, read_framed, write_framed

log = logging.getLogger("overdrive.compiler")
_lock = threading.Lock()
PARTS = b"OVDPART2"  # an entry of several save_cache_artifacts() payloads with the artifact keys each holds


def _chunk(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def join_parts(parts: list) -> bytes:
    """parts: [(artifact keys, payload)]."""
    return PARTS + b"".join(_chunk(json.dumps(sorted(keys)).encode()) + _chunk(payload) for keys, payload in parts)


def split_parts(payload: bytes) -> list:
    """[(artifact keys, payload)] of an entry; an entry written before parts existed is one payload of unknown keys."""
    if not payload.startswith(PARTS):
        return [(set(), payload)]
    parts, offset, chunks = [], len(PARTS), []
    while offset < len(payload):
        size = int.from_bytes(payload[offset:offset + 8], "little")
        chunks.append(payload[offset + 8:offset + 8 + size])
        offset += 8 + size
    if offset != len(payload) or len(chunks) % 2:
        raise ValueError("malformed parts")
    for keys, data in zip(chunks[::2], chunks[1::2]):
        parts.append((set(json.loads(keys)), data))
    return parts


def artifact_keys(info) -> set:
    """The cache entries a save_cache_artifacts() payload holds (a restart that only hit the cache saves them again)."""
    return {f"{kind}:{key}" for kind, keys in getattr(info, "artifacts", {}).items() for key in keys}


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
                for _, part in split_parts(payload):
                    torch.compiler.load_cache_artifacts(part)
        except Exception as error:  # noqa: BLE001 - a bad cache entry must never stop a generation
            log.warning("Overdrive: discarding the compile cache entry %s (%s); it will be rebuilt.", path, error)
            discard(path)
            return False
        log.info("Overdrive: loaded compiled artifacts from %s (%.1f MB)", path, (len(payload) + 40) / 1e6)
        return True

    def save(self, key: str) -> pathlib.Path | None:
        """Add what was compiled since the last save to entry `key` (a stop waits until it is written)."""
        path = self.path(key)
        with stops_held(), _lock:
            artifacts = torch.compiler.save_cache_artifacts()
            if not artifacts:
                return None
            parts = []
            if path.is_file():
                try:
                    parts = split_parts(read_framed(path))
                except Exception:  # noqa: BLE001 - a bad entry is replaced by what is new
                    parts = []
            keys = artifact_keys(artifacts[1])
            if keys and keys <= set().union(*(known for known, _ in parts)):
                return path  # nothing new: the entry already holds these
            payload = join_parts(parts + [(keys, artifacts[0])])
            write_framed(path, payload)
        log.info("Overdrive: saved compiled artifacts to %s (%.1f MB, %d part(s))", path, (len(payload) + 40) / 1e6,
                 len(parts) + 1)
        return path

    def frames_dir(self, key: str) -> pathlib.Path:
        """Where the precompiled frames of entry `key` live (compiler/precompiled.py)."""
        return self.directory / f"{key}.frames"

