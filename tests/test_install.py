"""scripts/install.sh run for real against a ComfyUI folder of the user's (COMFYUI_PATH): it names the version it found
and warns when that ComfyUI is older than the oldest Overdrive is tested on. (The fresh-machine path itself is what CI
runs before the suite.)"""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def comfyui_folder(root: pathlib.Path, version: str) -> pathlib.Path:
    """A ComfyUI folder as install.sh reads one: its entry point, version file and (here empty) requirements."""
    folder = root / f"ComfyUI-{version}"
    (folder / "custom_nodes").mkdir(parents=True)
    (folder / "main.py").write_text("")
    (folder / "requirements.txt").write_text("")
    (folder / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    return folder


@pytest.mark.parametrize("version, warned", [("0.7.0", True), ("0.38.1", False)])
def test_install_names_the_comfyui_it_found_and_warns_when_it_is_older_than_supported(tmp_path, version, warned):
    folder = comfyui_folder(tmp_path, version)
    env = dict(os.environ, COMFYUI_PATH=str(folder), OVERDRIVE_NO_SYSTEM_PACKAGES="1", PYTHON=sys.executable)
    run = subprocess.run(["bash", str(REPO / "scripts/install.sh")], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"Overdrive is set up: ComfyUI {version} at {folder}" in run.stdout
    assert ("older than 0.33.0" in run.stderr) == warned, run.stderr[-2000:]
    assert (folder / "custom_nodes" / "overdrive").resolve() == REPO


def test_install_refuses_an_unknown_option_before_installing_anything():
    run = subprocess.run(["bash", str(REPO / "scripts/install.sh"), "--test"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "usage: bash scripts/install.sh [--tests]" in run.stderr
