"""A stop the user asked for is not a failure: every fallback that keeps a generation running lets it through.

The core runs without ComfyUI, so ComfyUI's stop exception (comfy.model_management.InterruptProcessingException,
raised by its ops and its progress hook after POST /interrupt) is recognised by its module and name.
"""
STOP_EXCEPTIONS = {("comfy.model_management", "InterruptProcessingException")}


def is_interrupt(error: BaseException) -> bool:
    """KeyboardInterrupt, or a host's stop exception (or a subclass of one)."""
    if isinstance(error, KeyboardInterrupt):
        return True
    return any((cls.__module__, cls.__name__) in STOP_EXCEPTIONS for cls in type(error).__mro__)


def raise_if_interrupt(error: BaseException) -> None:
    """In an `except Exception` that falls back: a stop is re-raised, so the run ends as stopped and nothing is marked
    as failed."""
    if is_interrupt(error):
        raise error
