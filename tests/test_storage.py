"""The one storage layer (overdrive.core.storage) and the core's import: what every on-disk cache relies on."""
import json
import os
import subprocess
import sys

import pytest
import torch

from overdrive.core.storage import (CorruptEntry, atomic_file, cache_key, read_framed, read_framed_json, write_framed,
                                    write_framed_json)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "entry.bin"
    write_framed(path, b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            tmp.write_bytes(b"half a ne")
            raise RuntimeError("disk full")
    assert read_framed(path) == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.bin"]


def test_framing_refuses_truncated_edited_and_foreign_files(tmp_path):
    path = tmp_path / "entry.json"
    write_framed_json(path, {"layers": [1, 2, 3]})
    assert read_framed_json(path) == {"layers": [1, 2, 3]}
    data = path.read_bytes()
    for bad in (data[:-2], data.replace(b"2", b"7"), json.dumps({"layers": []}).encode(), b""):
        path.write_bytes(bad)
        with pytest.raises(CorruptEntry):
            read_framed_json(path)


def test_keys_change_with_every_part_and_with_the_device():
    cpu = torch.device("cpu")
    key = cache_key({"a": 1, "b": [2]}, cpu)
    assert key == cache_key({"b": [2], "a": 1}, cpu) and len(key) == 24
    assert key != cache_key({"a": 2, "b": [2]}, cpu)
    assert len(cache_key({"a": 1}, cpu, length=32)) == 32


def test_importing_the_core_does_no_work(tmp_path):
    """No hooks, no Redis, no folders until something is compiled, cached or watched."""
    code = """
import os, sys, torch
from torch.nn.modules import module as m
before = (len(m._global_module_registration_hooks), len(m._global_parameter_registration_hooks))
import overdrive.api, overdrive.compiler, overdrive.quantization, overdrive.step_cache, overdrive.core.weights_watch
import overdrive.attention.choice, overdrive.core.blockwise, overdrive.families, overdrive.core.storage
after = (len(m._global_module_registration_hooks), len(m._global_parameter_registration_hooks))
print(before == after, "TORCHINDUCTOR_REDIS_URL" in os.environ, sorted(os.listdir(os.environ["OVERDRIVE_CACHE_DIR"])))
"""
    env = dict(os.environ, OVERDRIVE_CACHE_DIR=str(tmp_path), OVERDRIVE_REDIS_URL="redis://127.0.0.1:1/0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "[]"], out.stdout
