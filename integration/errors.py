"""The one exception type for mistakes a user can fix.

Entry points catch it, print ``spotline: error: <message>`` on one line and exit 2.
Everything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input: the message names what is wrong and how to fix it."""


def one_line(exc: BaseException) -> str:
    """An exception as one line for a log or the coordinator (its message may be empty or
    long)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__
