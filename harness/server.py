"""Start and stop a real ComfyUI server process on loopback."""
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]


def find_comfyui() -> pathlib.Path:
    """COMFYUI_PATH, else the ComfyUI that scripts/install.sh unpacked; a clear error if neither exists."""
    path = pathlib.Path(os.environ.get("COMFYUI_PATH", REPO / ".comfyui" / "ComfyUI"))
    if not (path / "main.py").is_file():
        raise FileNotFoundError(f"No ComfyUI at {path}: run scripts/install.sh, or set COMFYUI_PATH to your ComfyUI folder.")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """`with ComfyServer(workdir) as server:` a ComfyUI on 127.0.0.1 running the Overdrive of this repository.

    Its custom nodes are a link to this repository alone (in a base folder of its own, removed at stop), and PYTHONPATH
    makes `import overdrive` load this repository too: a second clone or a worktree on the machine runs its own code,
    not the one ComfyUI's custom_nodes or pip point at. Its user, output, input and temp folders live under `workdir`
    and its database is in memory: two servers never wait on one database lock. Models come from ComfyUI's models
    folder and the extra paths given. The server's log goes to `workdir/comfyui.log`. On a machine without CUDA it
    runs with --cpu.
    """

    def __init__(self, workdir, comfyui_path=None, extra_args=(), env=None, startup_timeout=180):
        self.workdir = pathlib.Path(workdir)
        self.comfyui_path = pathlib.Path(comfyui_path) if comfyui_path else find_comfyui()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.env = env
        self.startup_timeout = startup_timeout
        self.process = None
        self.base = None  # the server's base folder while it runs
        self.log_path = self.workdir / "comfyui.log"
        self.output_dir = self.workdir / "output"

    def command(self):
        import torch

        args = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(self.port),
                "--base-directory", str(self.base), "--user-directory", str(self.workdir / "user"),
                "--output-directory", str(self.output_dir), "--input-directory", str(self.workdir / "input"),
                "--temp-directory", str(self.workdir / "temp"), "--database-url", "sqlite:///:memory:",
                "--disable-auto-launch"]
        models = self.comfyui_path / "models"
        if models.is_dir():  # the base folder would move it: ComfyUI's own models and Overdrive's caches stay there
            args += ["--models-directory", str(models)]
        if not torch.cuda.is_available():
            # SDPA attention: ComfyUI's default CPU attention asks for free memory mid-graph and breaks compiled graphs.
            args += ["--cpu", "--use-pytorch-cross-attention"]
        return args + self.extra_args

    def start(self):
        for sub in ("output", "input", "temp", "user"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **(self.env or {}))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self._make_base()), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(), cwd=self.comfyui_path, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode} at startup; see {self.log_path}:\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=5):
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {self.startup_timeout} s; see {self.log_path}")

    def _make_base(self) -> pathlib.Path:
        """A base folder whose custom_nodes/ holds one link, `overdrive`, to this repository; returns that custom_nodes
        folder, which is also the PYTHONPATH entry that makes `import overdrive` this repository."""
        self.base = pathlib.Path(tempfile.mkdtemp(prefix="overdrive-comfyui-"))
        custom_nodes = self.base / "custom_nodes"
        custom_nodes.mkdir()
        (custom_nodes / "overdrive").symlink_to(REPO, target_is_directory=True)
        return custom_nodes

    def log_tail(self, chars=4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)  # the link inside goes, not what it points to
            self.base = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def start_with_models(workdir, checkpoints: dict, other_files: dict | None = None, env=None) -> ComfyServer:
    """A started ComfyServer that sees `checkpoints` ({file name: path}) and `other_files` ({folder: {name: path}})
    through an extra_model_paths.yaml in `workdir`."""
    from .workflows import model_paths_config
    config = model_paths_config(workdir, checkpoints, other_files)
    return ComfyServer(workdir, extra_args=["--extra-model-paths-config", str(config)], env=env).start()
