"""Long work (compiling, calibrating) shown on ComfyUI's progress bar, with a heartbeat while it runs."""
import contextlib
import ctypes
import logging
import threading
import time

import comfy.model_management
import comfy.utils

from ..core.interrupts import raise_in_thread

log = logging.getLogger("overdrive")


class _StopInjector:
    """Raises ComfyUI's stop exception inside the working thread while its body runs: one torch.compile call (a block's
    whole trace, lowering and kernel builds) cannot be split, and would otherwise hold a stop until it ends (a cold DiT
    block compiles for tens of seconds on a GPU). The exception lands at the thread's next Python instruction, which
    the compiler's Python reaches often; torch.compile's error wrapping it is unwrapped by interrupts.raise_if_interrupt,
    so the graph stays usable and the next run compiles it from the start. An exception that lands while the thread
    runs a weakref callback or a `__del__` (the garbage collector runs them inside the compiler) is printed and
    dropped by Python: where the body still runs `AGAIN_AFTER_S` after a stop was raised, it is raised again. While the
    thread keeps finished work (interrupts.stops_held: a compiled frame being saved), the stop waits for the next
    heartbeat."""

    AGAIN_AFTER_S = 0.5  # longer than a raised stop takes to leave the body; short enough to stop the trace

    def __init__(self):
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.running, self.injected, self.injected_at = True, False, 0.0

    def inject(self) -> None:
        with self.lock:
            if self.running and not self.injected:
                self._raise_in_thread()

    def inject_again_if_lost(self) -> None:
        with self.lock:
            if self.running and self.injected and time.perf_counter() - self.injected_at >= self.AGAIN_AFTER_S:
                self._raise_in_thread()

    def _raise_in_thread(self) -> None:
        if raise_in_thread(self.thread_id, comfy.model_management.InterruptProcessingException):
            self.injected, self.injected_at = True, time.perf_counter()

    def finish(self) -> None:
        """The body ended (or raised): a stop sent but not yet raised is withdrawn and left pending for ComfyUI's
        progress hook, which raises it in this thread at a known point."""
        with self.lock:
            self.running = False
            if self.injected:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
                comfy.model_management.interrupt_current_processing(True)


@contextlib.contextmanager
def comfy_progress(label: str, expected_seconds: float = 60.0, interval: float = 0.5):
    """While the body runs, tick the executing node's progress bar (websocket 'progress' messages), and end the body
    with ComfyUI's stop exception as soon as a stop is requested (_StopInjector).

    Compilation happens inside a single call we cannot split, so a background thread advances the bar towards
    `expected_seconds`; it completes when the work ends. ComfyUI's progress hook raises (and clears) a pending stop
    request: in the heartbeat thread that would swallow it, so the heartbeat leaves a pending stop to the working
    thread.
    """
    total = max(int(expected_seconds / interval), 1)
    bar = comfy.utils.ProgressBar(total)
    done = threading.Event()
    start = time.perf_counter()
    stopper = _StopInjector()
    log.info("Overdrive: %s ... (once per architecture and shape; later runs reuse it)", label)

    def heartbeat():
        while not done.wait(interval):
            if stopper.injected:
                stopper.inject_again_if_lost()
                continue
            if comfy.model_management.processing_interrupted():
                stopper.inject()
                continue
            try:
                bar.update_absolute(min(int((time.perf_counter() - start) / interval), total - 1))
            except comfy.model_management.InterruptProcessingException:
                comfy.model_management.interrupt_current_processing(True)  # a stop that came in between: keep it
                stopper.inject()

    thread = threading.Thread(target=heartbeat, name="overdrive-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopper.finish()
        done.set()
        thread.join()
        log.info("Overdrive: %s %s in %.1f s", label, "stopped" if stopper.injected else "finished",
                 time.perf_counter() - start)
        bar.update_absolute(total)  # in this thread, a stop requested meanwhile raises: the prompt ends interrupted
