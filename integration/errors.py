"""The one exception type for mistakes a user can fix.

Entry points catch it, print ``spotline: error: <message>`` on one line and exit 2.
Everything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input: the message names what is wrong and how to fix it."""
