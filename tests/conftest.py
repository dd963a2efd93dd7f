import os
import pathlib
import random
import shutil
import subprocess
import tempfile

import pytest
import torch

# Compiled artifacts and generated checkpoints of test runs stay out of the user's cache (set before imports), in a
# folder of this run that is removed at its end (up to a few GB with the tiny SDXL checkpoint).
_TEST_CACHE = None if "OVERDRIVE_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="overdrive-test-cache-")
if _TEST_CACHE:
    os.environ["OVERDRIVE_CACHE_DIR"] = _TEST_CACHE
# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(int(os.environ.get("OVERDRIVE_TEST_THREADS", "2")))

from comfy_env import import_comfy_in_process  # noqa: E402


class EarlyProcess:
    """A test module's long run in a process of its own (the module's `start_early(workdir) -> argv`), started as soon
    as collection selects one of its tests: one test runs at a time and keeps about one of CI's two cores busy, so the
    run's minutes pass beside the other tests on the second core (one torch thread) instead of after them."""

    def __init__(self, argv_of):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="overdrive-early-"))  # removed by stop()
        self.log = self.workdir / "output.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv_of(self.workdir), stdout=log, stderr=subprocess.STDOUT,
                                            cwd=pathlib.Path(__file__).resolve().parents[1],
                                            env=dict(os.environ, OMP_NUM_THREADS="1"))

    def finished(self, timeout: float) -> pathlib.Path:
        """Its workdir, once it exited 0; its output's end in the failure otherwise."""
        code = self.process.wait(timeout)
        assert code == 0, f"exit code {code}; the end of its output:\n{self.log.read_text()[-6000:]}"
        return self.workdir

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


_EARLY = {}  # module name: its EarlyProcess, started at collection


@pytest.hookimpl(trylast=True)  # after `-k`, `-m` and `--deselect` took their tests out
def pytest_collection_modifyitems(config, items):
    # every xdist worker collects every test: there each fixture starts its own; --collect-only runs none
    if os.environ.get("PYTEST_XDIST_WORKER") or config.option.collectonly:
        return
    for module in {item.module for item in items if hasattr(getattr(item, "module", None), "start_early")}:
        _EARLY[module.__name__] = EarlyProcess(module.start_early)


@pytest.fixture(scope="module")
def early_process(request) -> pathlib.Path:
    """The workdir of this module's `start_early` run, once it finished (started now where collection did not)."""
    early = _EARLY.pop(request.module.__name__, None) or EarlyProcess(request.module.start_early)
    try:
        yield early.finished(timeout=1800)
    finally:
        early.stop()  # also the process a timeout or a failed test left running


def pytest_sessionfinish():
    for early in _EARLY.values():  # started, but its tests did not run (a stopped run)
        early.stop()
    if _TEST_CACHE:  # servers and workers are stopped by now (fixture teardown comes first)
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def fixed_random_stream():
    """Every test draws from the same random stream on every run, so a tolerance that passed once cannot fail on a
    later run's draw (an unseeded draw once failed a half-step bound on CI)."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's real modules, imported in this process (CPU)."""
    return import_comfy_in_process()


@pytest.fixture(scope="session")
def builtin_checkpoints():
    """Built-in tiny SD1.5 checkpoints (seeds 0 and 1: one architecture, two sets of weights)."""
    from overdrive.builtin_models import ensure_checkpoint

    return {"overdrive-builtin-sd15.safetensors": ensure_checkpoint("sd15", "tiny", seed=0),
            "overdrive-builtin-sd15-seed1.safetensors": ensure_checkpoint("sd15", "tiny", seed=1)}


def start_server(workdir, checkpoints, env=None, other_files=None):
    from overdrive.harness.server import start_with_models
    return start_with_models(workdir, checkpoints, other_files, env)


@pytest.fixture(scope="session")
def builtin_dit_files(comfy):
    """The built-in tiny diffusion models and VAEs of the families the CPU suite runs ({folder: {name: path}}), laid
    out by ComfyUI."""
    from overdrive.builtin_models.dit import CPU_SUITE_FAMILIES
    from overdrive.harness.workflows import builtin_dit_files
    return builtin_dit_files(CPU_SUITE_FAMILIES)


@pytest.fixture(scope="session")
def server(tmp_path_factory, builtin_checkpoints, builtin_dit_files):
    """A real ComfyUI server on loopback with Overdrive in custom_nodes, the built-in checkpoints and DiT files, and the
    reference models with learned weights."""
    from overdrive.builtin_models import learned
    files = {folder: {**builtin_dit_files.get(folder, {}), **learned.files().get(folder, {})}  # + the learned ones
             for folder in {*builtin_dit_files, *learned.files()}}
    srv = start_server(tmp_path_factory.mktemp("comfyui"), builtin_checkpoints, other_files=files)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from overdrive.harness import ComfyClient
    return ComfyClient(server.url)


@pytest.fixture(scope="session")
def sdxl_checkpoint(server):
    """The built-in tiny SDXL checkpoint (2.4 GB, made on first use), added to the running server's checkpoints."""
    from overdrive.builtin_models import ensure_checkpoint
    from overdrive.harness.workflows import BUILTIN_NAMES, link_checkpoints

    link_checkpoints(server.workdir, {BUILTIN_NAMES["sdxl"]: ensure_checkpoint("sdxl", "tiny")})
    return BUILTIN_NAMES["sdxl"]
