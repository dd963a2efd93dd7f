"""A stop the user asked for is not a failure: every fallback that keeps a generation running lets it through.

The core runs without ComfyUI, so ComfyUI's stop exception (comfy.model_management.InterruptProcessingException,
raised by its ops and its progress hook after POST /interrupt) is recognised by its module and name. A stop raised
inside torch.compile comes back wrapped in the compiler's own error: it is found in the chain of causes.
"""
STOP_EXCEPTIONS = {("comfy.model_management", "InterruptProcessingException")}


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
