"""Long work (compiling, calibrating) shown on ComfyUI's progress bar, with a heartbeat while it runs."""
import contextlib
import logging
import threading
import time

import comfy.utils

log = logging.getLogger("overdrive")


@contextlib.contextmanager
def comfy_progress(label: str, expected_seconds: float = 60.0, interval: float = 0.5):
    """While the body runs, tick the executing node's progress bar (websocket 'progress' messages).

    Compilation happens inside a single call we cannot split, so a background thread advances the bar
    towards `expected_seconds`; it completes when the work ends.
    """
    total = max(int(expected_seconds / interval), 1)
    bar = comfy.utils.ProgressBar(total)
    done = threading.Event()
    start = time.perf_counter()
    log.info("Overdrive: %s ... (once per architecture and shape; later runs reuse it)", label)

    def heartbeat():
        while not done.wait(interval):
            bar.update_absolute(min(int((time.perf_counter() - start) / interval), total - 1))

    thread = threading.Thread(target=heartbeat, name="overdrive-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.update_absolute(total)
        log.info("Overdrive: %s finished in %.1f s", label, time.perf_counter() - start)
