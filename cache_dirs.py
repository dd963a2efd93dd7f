"""Where Overdrive keeps what it computes once (compiled graphs, quantization decisions, built-in checkpoints)."""
import os
import pathlib


def cache_dir(kind: str, default_root=None) -> pathlib.Path:
    """`$OVERDRIVE_CACHE_DIR/<kind>`; without it `<default_root>/<kind>` (ComfyUI: beside its models), else
    `~/.cache/overdrive/<kind>`. Read at each call, so a changed environment takes effect."""
    root = os.environ.get("OVERDRIVE_CACHE_DIR") or default_root or pathlib.Path.home() / ".cache" / "overdrive"
    return pathlib.Path(root) / kind
