"""A stop the user asked for is not a failure: every fallback that keeps a generation running lets it through.

The core runs without ComfyUI, so ComfyUI's stop exception (comfy.model_management.InterruptProcessingException,
raised by its ops and its progress hook after POST /interrupt) is recognised by its module and name. A stop raised
inside torch.compile comes back wrapped in the compiler's own error: it is found in the chain of causes.

A host raises its stop inside work it cannot split (one compile) with `raise_in_thread`; work that is finished and
only being kept (a compiled frame written to disk) holds such stops with `stops_held`, so that a stop does not throw
it away.
"""
import contextlib
import ctypes
import threading

# A constant, by name: the core imports no host. ComfyUI's is the only host stop there is (the diffusers API's is
# KeyboardInterrupt).
STOP_EXCEPTIONS = frozenset({("comfy.model_management", "InterruptProcessingException")})
_held: dict = {}  # thread id -> how many stops_held sections it is in
_held_lock = threading.Lock()


def _is_stop(error: BaseException) -> bool:
    if isinstance(error, KeyboardInterrupt):
        return True
    return any((cls.__module__, cls.__name__) in STOP_EXCEPTIONS for cls in type(error).__mro__)


def stop_in(error: BaseException | None) -> BaseException | None:
    """The stop (KeyboardInterrupt, or a host's stop exception or a subclass of one) that `error` is or was raised
    from, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if _is_stop(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def is_interrupt(error: BaseException) -> bool:
    return stop_in(error) is not None


def raise_if_interrupt(error: BaseException) -> None:
    """In an `except Exception` that falls back: a stop is re-raised as itself (not the error wrapping it), so the run
    ends as stopped and nothing is marked as failed."""
    stop = stop_in(error)
    if stop is not None:
        raise stop


@contextlib.contextmanager
def stops_held():
    """While the body runs, a stop `raise_in_thread` would raise in this thread waits (its caller tries again): for
    keeping work already done, such as a finished compile's frame and artifacts being written, which a stop landing
    mid-write would lose (the next restart compiled again)."""
    ident = threading.get_ident()
    try:
        with _held_lock:
            _held[ident] = _held.get(ident, 0) + 1
        yield
    finally:
        with _held_lock:
            depth = _held.pop(ident, 1) - 1
            if depth > 0:
                _held[ident] = depth


def raise_in_thread(thread_id: int, exception_type) -> bool:
    """Raise `exception_type` in thread `thread_id` at its next Python instruction; False, raising nothing, while that
    thread holds stops (stops_held)."""
    with _held_lock:
        if thread_id in _held:
            return False
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception_type))
        return True
