"""The exception types a user sees as one line: user mistakes and lost tasks.

A `UserError` is a bad value the user can fix (a name, a size, a path, a
cluster description). Its message is one line that names the bad value, the
rule and the fix. The command line prints it without a traceback and exits
with status 2. It lives in `strategies/` because that is the lowest layer
that raises it; `trainer/` raises the same class.
"""


class UserError(ValueError):
    """A mistake in the user's input, explained in one line."""


class TaskLost(Exception):
    """Another task of the cluster stopped answering (or never came up); restart the cluster."""
