"""Where the real ComfyUI under test lives, and how to import it in-process (no mocks: its own modules)."""
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def comfyui_path() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("COMFYUI_PATH", REPO / ".comfyui" / "ComfyUI"))
    if not (path / "main.py").is_file():
        raise RuntimeError(
            f"No ComfyUI at {path}. Run scripts/install.sh (it unpacks one), or set COMFYUI_PATH to a ComfyUI checkout."
        )
    return path


def import_comfy_in_process():
    """Import ComfyUI's own modules into this process, configured for the CPU like `main.py --cpu`."""
    path = str(comfyui_path())
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401  (reads the args above once, at import)
    import comfy.sd  # noqa: F401

    return sys.modules["comfy"]
