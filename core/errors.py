"""Overdrive's own exceptions, named the same wherever they surface.

ComfyUI loads a custom node's package under its folder's path, and its HTTP API reports an error's type as the class's
module and name: `/home/me/ComfyUI/custom_nodes/overdrive.compiler.switch_weights.WeightMismatchError`, another string
on every machine. A class based on OverdriveError is named `overdrive.<subpackage>.<module>.<class>` however the
package was loaded, and its message starts with its name, for clients that show only the message.
"""
PACKAGE = "overdrive"
# This package's name as it was imported: "overdrive", or the path-based name ComfyUI gives its custom-node folder.
_IMPORTED_AS = __package__.rpartition(".")[0]  # this module is <package>.core.errors


def stable_module(module: str) -> str:
    """`module` named under `overdrive.` when it belongs to this package, whatever the package was imported as."""
    if module == _IMPORTED_AS or module.startswith(_IMPORTED_AS + "."):
        return PACKAGE + module[len(_IMPORTED_AS):]
    return module


class OverdriveError(Exception):
    """The base of Overdrive's exceptions, listed first beside the builtin kind callers catch:
    `class WeightMismatchError(OverdriveError, ValueError)`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = stable_module(cls.__module__)

    def __str__(self):
        message, name = super().__str__(), type(self).__name__
        if message.startswith(name):
            return message
        return f"{name}: {message}" if message else name


def error_line(error: BaseException, limit: int = 300) -> str:
    """`Type: message`, its first line cut at `limit` characters (an Overdrive error's message already starts so)."""
    text = str(error) if isinstance(error, OverdriveError) else f"{type(error).__name__}: {error}"
    return text.splitlines()[0][:limit]
