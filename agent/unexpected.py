"""How the agent words a failure it did not foresee, for a claim's error, an Event or the terminal: a backend's or a
plugin's bug, or an operating-system error that no code turned into a message of its own. The words say what
happened as an operator reads it, never Python's exception names or errno texts; whoever fixes a bug finds its
traceback in the log, which the caller writes."""

from __future__ import annotations

from backends.contract import BackendError

__all__ = ["unexpected"]


def unexpected(e: BaseException) -> str:
    """What went wrong, for "<what was being done>: <this>"."""
    if isinstance(e, BackendError):
        return str(e)  # a backend's own words
    if isinstance(e, ModuleNotFoundError) and e.name:
        return f"module {e.name} is not installed"
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror[0].lower() + e.strerror[1:]
        return f"{text}: {e.filename}" if e.filename else text
    if isinstance(e, TimeoutError):
        return "it timed out"
    if (isinstance(e, RuntimeError) or type(e).__module__ != "builtins") and str(e):
        return str(e)  # raised with its author's words, as a plugin raises its own errors
    # Python's own (a KeyError, a TypeError...): its text speaks of the code, not of what the operator can fix.
    return "it failed unforeseen (a bug: the log has where)"
