"""Worker processes that each hold a copy of a model and run their part of its calls.

Rank 0 is the calling process (ComfyUI's); ranks 1.. are started by torch.multiprocessing (spawn) and joined into one
torch.distributed group with it: NCCL where every rank has a GPU of its own, gloo on the CPU. Tensors travel by
torch.distributed; a small control message per call travels on a pipe, which is also how a dead worker is noticed:
rank 0 never blocks on a worker without first hearing from it, so a worker that dies fails the call with WorkerDied
instead of hanging it. `close` stops every worker; none outlives the pool.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import socket
import sys
import threading
import time
import traceback
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils import _pytree as pytree

from ..core.errors import OverdriveError
from .agreement import whole_group_call
from .sequence_split import forget_sequence_groups

READY_TIMEOUT_S = 600.0  # a worker loads its copy of the model before it is ready
GROUP_TIMEOUT_S = 120.0  # the group's own limit on a transfer or joining: a backstop, the pipes notice deaths first
POLL_S = 0.05
DOING = {"joining": "starting", "ready": "loading its model", "receiving": "receiving a call",
         "done": "running its part of a call", "peak": "reading its peak memory"}  # what a worker is doing until it sends each message


class WorkerDied(OverdriveError, RuntimeError):
    """A worker process ended or failed; the pool is closed, and a new one starts fresh workers."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where rank `rank` of `world_size` runs: its device and the torch.distributed backend."""
    world_size: int
    cuda: bool

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.cuda else torch.device("cpu")


class _TensorSlot:
    """Where a tensor was in a packed call (it travels apart)."""


def _pack(tree) -> tuple:
    """(header, tensors): the tensors of a nested call travel by torch.distributed, the rest in the header."""
    leaves, spec = pytree.tree_flatten(tree)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    plain = [_TensorSlot() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    meta = [(tuple(t.shape), t.dtype) for t in tensors]
    return (spec, plain, meta), [t.contiguous() for t in tensors]


def _unpack(header, tensors: list):
    spec, plain, _ = header
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if isinstance(leaf, _TensorSlot) else leaf for leaf in plain], spec)


def _receive(header, src: int, device) -> list:
    tensors = []
    for shape, dtype in header[2]:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src)
        tensors.append(tensor)
    return tensors


def _send(tensors: list, dst: int, device) -> None:
    for tensor in tensors:
        dist.send(tensor.to(device), dst=dst)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(placement: Placement, rank: int, port: int) -> None:
    if placement.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(placement.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=placement.world_size, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


@contextlib.contextmanager
def _main_module_hidden():
    """Spawned processes import their parent's main module to unpickle what it defines; a worker needs nothing from
    it, and ComfyUI's main.py (or a script without a main guard) would run again in every worker."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _worker_main(rank: int, placement: Placement, port: int, factory, connection) -> None:
    """A worker: its copy of the model, then one call after another until told to stop (or its parent goes)."""
    try:
        connection.send(("joining", None))
        _join_group(placement, rank, port)
        device = placement.device(rank)
        model = factory(device)
        connection.send(("ready", None))
        while True:
            message, header = connection.recv()
            if message == "stop":
                break
            if message == "peak":  # its GPU's peak allocation since the last reading (benchmarks)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                connection.send(("peak", peak))
                continue
            if message == "load":  # another model into this process: the old copy goes first
                model = None
                _give_back(device)
                model = header(device)
                connection.send(("ready", None))
                continue
            connection.send(("receiving", None))
            x, timestep, kwargs = _unpack(header, _receive(header, 0, device))
            with torch.inference_mode(), whole_group_call(message != "call"):
                out = model(x, timestep, **kwargs)
            if message == "call_everywhere":  # rank 0 holds the whole output too
                connection.send(("done", None))
                continue
            out_header, tensors = _pack(out)
            connection.send(("done", out_header))
            _send(tensors, 0, device)
    except (EOFError, KeyboardInterrupt):  # the parent went away or was interrupted: nothing to report to
        pass
    except BaseException:  # noqa: BLE001 - reported to rank 0, which fails the call with it
        try:
            connection.send(("error", traceback.format_exc()[-4000:]))
        except (BrokenPipeError, OSError):
            pass
    finally:
        leave_group()


def _give_back(device) -> None:
    """A worker's model let go: its CUDA graphs that held collectives dropped, its memory given back."""
    from ..compiler.block_graphs import release_collective_graphs
    release_collective_graphs()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def leave_group() -> None:
    """Leave the torch.distributed group, first dropping the CUDA graphs that recorded its collectives (with them
    held, NCCL's destroy_process_group hangs)."""
    if not dist.is_initialized():
        return
    from ..compiler.block_graphs import release_collective_graphs
    release_collective_graphs()
    forget_sequence_groups()
    dist.destroy_process_group()


class WorkerPool:
    """`world_size - 1` workers, each running `factory(device)` once to get its model function
    (x, timestep, **kwargs) -> output; `run` hands each worker one part of a call while rank 0 runs the first."""

    def __init__(self, factory, world_size: int, cuda: bool | None = None):
        if world_size < 2:
            raise ValueError(f"a worker pool needs 2 or more processes, not {world_size}")
        cuda = torch.cuda.is_available() if cuda is None else cuda
        if cuda and torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} processes need {world_size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
        self.placement, self.factory = Placement(world_size, cuda), factory
        self.processes, self.connections = [], []

    @property
    def device(self) -> torch.device:
        return self.placement.device(0)

    def start(self) -> "WorkerPool":
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; close the other pool first")
        context, port = mp.get_context("spawn"), _free_port()
        for rank in range(1, self.placement.world_size):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(rank, self.placement, port, self.factory, child),
                                      daemon=True, name=f"overdrive-worker-{rank}")
            with _main_module_hidden():
                process.start()
            child.close()
            self.processes.append(process)
            self.connections.append(parent)
        try:
            for rank in range(1, self.placement.world_size):  # each has unpickled its model's factory: it runs
                self._expect(rank, "joining", READY_TIMEOUT_S)
            _join_group(self.placement, 0, port)
            for rank in range(1, self.placement.world_size):
                self._expect(rank, "ready", READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        return self

    def _check_alive(self, rank: int, what: str) -> None:
        process = self.processes[rank - 1]
        if not process.is_alive():
            raise WorkerDied(f"Overdrive's worker {rank} ended (exit code {process.exitcode}) while {DOING[what]}: the "
                             "prompt fails, and the next one starts fresh workers")

    def _expect(self, rank: int, what: str, timeout: float | None = None):
        """The worker's next message, which must be `what`; WorkerDied if it dies, fails, or stays silent too long."""
        connection = self.connections[rank - 1]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not connection.poll(POLL_S):
            self._check_alive(rank, what)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDied(f"Overdrive's worker {rank} sent nothing for {timeout:.0f} s ({DOING[what]})")
        try:
            message, payload = connection.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it is ending
            self.processes[rank - 1].join(timeout=10)
            self._check_alive(rank, what)
            raise WorkerDied(f"Overdrive's worker {rank} closed its pipe while {DOING[what]}") from None
        if message == "error":
            raise WorkerDied(f"Overdrive's worker {rank} failed while {DOING[what]}:\n{payload}")
        if message != what:
            raise WorkerDied(f"Overdrive's worker {rank} answered {message!r} to {what!r}")
        return payload

    def run(self, parts: list, local) -> list:
        """Each part's output: parts[0] by `local` here, parts[r] by worker r (workers beyond the parts wait). Parts
        are (x, timestep, kwargs)."""
        if not 1 <= len(parts) <= self.placement.world_size:
            raise ValueError(f"{len(parts)} parts for {self.placement.world_size} processes")
        whole = len(parts) == self.placement.world_size  # every process runs a part: they decide alike
        try:
            self._hand_out("call_whole_group" if whole else "call", parts[1:])
            x, timestep, kwargs = parts[0]
            with whole_group_call(whole):
                outputs = [local(x, timestep, **kwargs)]
            for rank in range(1, len(parts)):
                header = self._expect(rank, "done")
                outputs.append(_unpack(header, _receive(header, rank, self.device)))
            return outputs
        except BaseException:  # a failed or interrupted call leaves the workers mid-protocol: start afresh next time
            self.close()
            raise

    def run_everywhere(self, call: tuple, local):
        """`local()`'s output, this process's run of the call (x, timestep, kwargs) that every worker runs too: one
        computation split between the processes by the call itself (its collectives: sequence parallelism). A worker
        that fails or dies meanwhile fails the call with WorkerDied, saying which and why."""
        try:
            self._hand_out("call_everywhere", [call] * (self.placement.world_size - 1))
            with self._watched(), whole_group_call():
                out = local()
            for rank in range(1, self.placement.world_size):
                self._expect(rank, "done")
            return out
        except WorkerDied:
            self.close()
            raise
        except BaseException as error:  # a collective broken by a worker's end reads as gloo's or NCCL's own error
            died = self._failed_worker()
            self.close()
            if died is not None:
                raise died from error
            raise

    @contextlib.contextmanager
    def _watched(self):
        """While this process is inside the call's collectives: a worker that ends aborts the group, so that NCCL's
        collectives raise instead of waiting for the group's timeout (gloo's notice the closed connection)."""
        done = threading.Event()

        def watch():
            while not done.wait(POLL_S):
                if not self.alive():
                    if self.placement.cuda:
                        dist.distributed_c10d._abort_process_group()
                    return
        watcher = threading.Thread(target=watch, daemon=True, name="overdrive-worker-watch")
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()

    def _failed_worker(self, wait_s: float = 2.0) -> WorkerDied | None:
        """The WorkerDied of a worker that reported a failure or ended (within `wait_s`, as its report may trail the
        broken collective), or None."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for rank, (process, connection) in enumerate(zip(self.processes, self.connections), start=1):
                if connection.poll() or not process.is_alive():
                    try:
                        self._expect(rank, "done", timeout=POLL_S)
                    except WorkerDied as died:
                        return died
            time.sleep(POLL_S)
        return None

    def _hand_out(self, message: str, parts: list) -> None:
        """parts[r - 1] to worker r."""
        for rank, part in enumerate(parts, start=1):
            header, tensors = _pack(part)
            self.connections[rank - 1].send((message, header))
            self._expect(rank, "receiving")
            _send(tensors, rank, self.device)

    def peak_memory(self) -> list:
        """Each process's peak GPU allocation in bytes since the last reading (this one's first; 0 on the CPU), each
        reset."""
        peaks = [torch.cuda.max_memory_allocated(self.device) if self.placement.cuda else 0]
        if self.placement.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        for rank, connection in enumerate(self.connections, start=1):
            connection.send(("peak", None))
            peaks.append(self._expect(rank, "peak"))
        return peaks

    def reload(self, factory) -> "WorkerPool":
        """The same processes and group with another model: each worker drops its copy and builds `factory`'s (no
        process start, no ComfyUI import). A worker that fails to fails this like `start`."""
        try:
            for connection in self.connections:
                connection.send(("load", factory))
            for rank in range(1, self.placement.world_size):
                self._expect(rank, "ready", READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.factory = factory
        return self

    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Stop every worker (asked first, then killed) and leave the group. Safe to call twice."""
        for connection in self.connections:
            try:
                connection.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []
        leave_group()
