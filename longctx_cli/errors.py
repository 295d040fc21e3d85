"""The one exception type for mistakes a user can fix.

Anything raised as `UserError` is shown by the CLI as a single paragraph (no traceback)
and the process exits with status 2.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's config, data or command line; the message says how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        self.where = where
        self.fix = fix
        parts = [f"{where}: {message}" if where else message]
        if fix:
            parts.append(f"Fix: {fix}")
        super().__init__(" ".join(parts))


# The exit status of a preempted run whose checkpoint is complete: EX_TEMPFAIL ("try again
# later"), distinct from success (0), a failure (1) and a user error (2).
PREEMPTED_EXIT = 75
