"""scripts/run_main.py before it starts ComfyUI: its arguments and prompt are checked first, and it runs the code of the
clone it lives in. (The job itself, on a real server: tests/test_learned_models.py runs its workflow.)"""
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "run_main.py"


def run_main(*arguments, out):
    return subprocess.run([sys.executable, str(SCRIPT), *arguments, "--out", str(out)], capture_output=True, text=True,
                          timeout=300)


def test_a_bad_prompt_or_argument_is_named_in_one_line_before_comfyui_starts(tmp_path):
    cases = {("--prompt", "large red circle stripd"): ("'stripd'", "striped, dotted"),
             ("--arch", "fluxx"): ("'fluxx'", "scenes_sd35"),
             ("--arch", "flux", "--prompt", "large red circle"): ("--prompt", "scenes or scenes_sd35"),
             ("--size", "100"): ("--size 100", "multiple of 16"),
             ("--repeats", "0"): ("--repeats 0", "1 or more")}
    for arguments, (bad, choices) in cases.items():
        result = run_main(*arguments, out=tmp_path / "out")
        assert result.returncode == 2, (arguments, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and bad in lines[0] and choices in lines[0], (arguments, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and not result.stdout.strip(), arguments
    assert not (tmp_path / "out" / "comfyui.log").exists()  # no server was started


def test_the_script_runs_the_code_of_the_clone_it_lives_in(tmp_path):
    """A second clone on the machine (here a copy of this one) runs its own `overdrive` and harness, not the package
    pip installed."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO, clone, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".comfyui", "out", "__pycache__", "*.safetensors", "bench", "tests"))
    probe = ("import os, runpy, sys; runpy.run_path(sys.argv[1]); "
             "import overdrive, overdrive.harness.server as server; "
             "print(os.path.realpath(os.path.dirname(overdrive.__file__))); print(server.REPO)")
    result = subprocess.run([sys.executable, "-c", probe, str(clone / "scripts" / "run_main.py")], capture_output=True,
                            text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr[-3000:]
    package, harness = result.stdout.strip().splitlines()[-2:]
    assert pathlib.Path(package) == clone.resolve() and pathlib.Path(harness) == clone.resolve(), result.stdout
