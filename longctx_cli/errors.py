"""The one exception type for mistakes a user can fix.

Anything raised as `UserError` is shown by the CLI as a single paragraph (no traceback)
and the process exits with status 2.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's config, data or command line; the message says how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None,
                 key: str | None = None):
        self.message, self.where, self.fix = message, where, fix
        self.key = key  # the config key whose value is wrong, where one is (fixes re-checked)
        parts = [f"{where}: {message}" if where else message]
        if fix:
            parts.append(f"Fix: {fix}")
        super().__init__(" ".join(parts))


# The exit status of a preempted run whose checkpoint is complete: EX_TEMPFAIL ("try again
# later"), distinct from success (0), a failure (1) and a user error (2).
PREEMPTED_EXIT = 75


def print_error(error: BaseException) -> None:
    """One wrapped paragraph on stderr with a red `error:` prefix, no traceback."""
    from rich.console import Console
    from rich.text import Text

    message = Text("error: ", style="bold red")
    message.append(str(error))  # plain text: brackets in messages are not rich markup
    Console(stderr=True).print(message)


def print_interrupted() -> None:
    """The one line a Ctrl-C leaves (exit status 130), instead of a traceback."""
    from rich.console import Console

    Console(stderr=True).print("\n[yellow]interrupted[/]")
