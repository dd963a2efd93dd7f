"""Long work (compiling, calibrating) shown on ComfyUI's progress bar, with a heartbeat while it runs."""
import contextlib
import logging
import threading
import time

import comfy.model_management
import comfy.utils

log = logging.getLogger("overdrive")


@contextlib.contextmanager
def comfy_progress(label: str, expected_seconds: float = 60.0, interval: float = 0.5):
    """While the body runs, tick the executing node's progress bar (websocket 'progress' messages).

    Compilation happens inside a single call we cannot split, so a background thread advances the bar
    towards `expected_seconds`; it completes when the work ends. ComfyUI's progress hook raises (and clears) a
    pending stop request: in the heartbeat thread that would swallow it, so the heartbeat leaves a pending stop
    alone and the bar's last update, in the working thread, raises it when the work ends.
    """
    total = max(int(expected_seconds / interval), 1)
    bar = comfy.utils.ProgressBar(total)
    done = threading.Event()
    start = time.perf_counter()
    log.info("Overdrive: %s ... (once per architecture and shape; later runs reuse it)", label)

    def heartbeat():
        while not done.wait(interval):
            if comfy.model_management.processing_interrupted():
                return
            try:
                bar.update_absolute(min(int((time.perf_counter() - start) / interval), total - 1))
            except comfy.model_management.InterruptProcessingException:
                comfy.model_management.interrupt_current_processing(True)  # a stop that came in between: keep it
                return

    thread = threading.Thread(target=heartbeat, name="overdrive-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        log.info("Overdrive: %s finished in %.1f s", label, time.perf_counter() - start)
        bar.update_absolute(total)  # in this thread, a stop requested meanwhile raises: the prompt ends interrupted
