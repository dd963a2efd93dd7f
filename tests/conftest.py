import os
import random
import shutil
import tempfile

import pytest

# Compiled artifacts and generated checkpoints of test runs stay out of the user's cache (set before imports), in a
# folder of this run that is removed at its end (up to a few GB with the tiny SDXL checkpoint). Under pytest-xdist the
# controller makes that folder and each worker caches into a folder of its own inside it (compiled graphs, quantization
# decisions: a test that counts compiles or cache hits sees its own worker's alone), while the built-in model files
# (checkpoints/, dit/: the same bytes for the same arguments, written atomically) are made once, in folders the workers
# share.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_RUN_CACHE = os.environ.get("OVERDRIVE_TEST_RUN_CACHE")
_TEST_CACHE = None  # the folder this process made and removes at its end
if _WORKER and _RUN_CACHE:
    _own = os.path.join(_RUN_CACHE, _WORKER)
    for _kind in ("checkpoints", "dit"):
        os.makedirs(os.path.join(_RUN_CACHE, _kind), exist_ok=True)
        os.makedirs(_own, exist_ok=True)
        if not os.path.lexists(os.path.join(_own, _kind)):
            os.symlink(os.path.join(_RUN_CACHE, _kind), os.path.join(_own, _kind))
    os.environ["OVERDRIVE_CACHE_DIR"] = _own
elif "OVERDRIVE_CACHE_DIR" not in os.environ:
    _TEST_CACHE = tempfile.mkdtemp(prefix="overdrive-test-cache-")
    os.environ["OVERDRIVE_CACHE_DIR"] = os.environ["OVERDRIVE_TEST_RUN_CACHE"] = _TEST_CACHE
    # Inductor's CPU kernels compile through tests/cxx_pch.sh (g++ with their common header precompiled once, in this
    # run's folder; set before torch's Inductor reads CXX), unless the run names a compiler of its own.
    if "CXX" not in os.environ:
        os.environ["CXX"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cxx_pch.sh")
        os.environ["OVERDRIVE_TEST_PCH_DIR"] = os.path.join(_TEST_CACHE, "pch")

import torch  # noqa: E402

# Two cores on CI: keep torch from oversubscribing them (a thread each when two xdist workers share them).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("OVERDRIVE_TEST_THREADS", str(max(1, 2 // _WORKERS)))))

from comfy_env import import_comfy_in_process  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _TEST_CACHE:  # servers and workers are stopped by now (fixture teardown comes first)
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


# pytest-xdist's `--dist loadgroup` (README) runs each xdist group on one worker. Here a group is a test file (its
# module fixtures are built once), with two exceptions:
# - the files whose tests use this run's ComfyUI server (`server`) are one group: one server starts, and what it
#   compiled for one file it keeps for the next, as in a run in one process;
# - test_dit_families.py goes by family: each family's model, compiles and files are fixtures of that family alone, so
#   two workers can take its families apart.
SERVER_GROUP = "comfyui-server"
FAMILY_SPLIT_FILES = {"test_dit_families.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    server_files = {item.path for item in items if "server" in getattr(item, "fixturenames", ())}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path in server_files:
            group = SERVER_GROUP
        elif item.path.name in FAMILY_SPLIT_FILES and "family" in params:
            group = f"{item.path.name}[{params['family']}]"
        else:
            group = item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


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
