"""How every entry point ends: one line for an error, fixed exit codes, a debug switch.

Entry points (`python -m circuitkit.run`, `circuitkit ...`, `gradian ...`) wrap their work in
`run_entry`: an error a user can act on prints one line naming the problem and the fix, an
unexpected one prints one line saying it is a bug, Ctrl-C prints one line and exits 130, and
output piped into a reader that stops early (`| head`) ends quietly with 0. Set
the environment variable ``CIRCUITKIT_DEBUG=1`` to see the Python traceback instead.

Exit codes: 0 ok, 1 the work failed (bad data, a failed stage, an I/O error), 2 the command or
its configuration is wrong (nothing ran), 130 interrupted.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape

DEBUG_ENV = "CIRCUITKIT_DEBUG"
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UserError(Exception):
    """An error whose message tells the user what was wrong and what to do.

    `exit_code` is 2 when the command or configuration was wrong (nothing ran), else 1.
    """

    exit_code = EXIT_FAILED

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def debug_enabled() -> bool:
    """True when CIRCUITKIT_DEBUG is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def error_console() -> Console:
    """A console on stderr; soft-wrapped so one message stays one logical line."""
    return Console(stderr=True, soft_wrap=True)


def print_error(message: str, console: Console | None = None, label: str = "error") -> None:
    """Print `label: message` on stderr. The message is escaped: `stages=[data,pruning]` stays
    as written instead of being read as rich markup."""
    (console or error_console()).print(f"[bold red]{label}:[/bold red] {escape(str(message))}")


def describe_os_error(err: OSError) -> str:
    """One line for an OSError that names the file and what to do."""
    where = f" {err.filename!r}" if err.filename else ""
    if err.errno == errno.ENOSPC:
        return f"no space left on the device while writing{where}: free some space or write elsewhere."
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied for{where}: choose a directory you can write to (or fix its permissions)."
    if err.errno == errno.EISDIR:
        return f"{where.strip()} is a directory, but a file was expected."
    if err.errno == errno.ENOTDIR:
        return f"{where.strip()} is not a directory."
    if err.errno == errno.ENOENT:
        return f"{where.strip()} does not exist."
    return f"{err.strerror or type(err).__name__}{':' if where else ''}{where}"


def exit_code_and_message(err: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for an exception raised by an entry point."""
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted (Ctrl-C); what was already written is kept."
    if isinstance(err, UserError):
        return err.exit_code, str(err)
    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError | IsADirectoryError):
        return EXIT_FAILED, describe_os_error(err)
    if isinstance(err, ValueError | FileNotFoundError | IsADirectoryError | LookupError | OverflowError):
        return EXIT_FAILED, str(err) or type(err).__name__
    return EXIT_FAILED, (f"internal error {type(err).__name__}: {err} (this is a bug; rerun with"
                         f" {DEBUG_ENV}=1 for the traceback and please report it)")


def run_entry(fn: Callable[..., Any], *args: Any, console: Console | None = None, **kwargs: Any) -> int:
    """Call `fn(*args, **kwargs)` and turn what it raises into one line and an exit code.

    Returns fn's int result (0 when it returns None). SystemExit passes through unchanged.
    With CIRCUITKIT_DEBUG set, exceptions propagate with their traceback.
    """
    try:
        result = fn(*args, **kwargs)
    except SystemExit as exit_:
        if isinstance(exit_.__context__, BrokenPipeError):  # rich's Console exits 1 when stdout's reader left
            quiet_stdout()
            return 0
        raise
    except BrokenPipeError:  # the reader of stdout went away (`circuitkit show ... | head`): not an error
        quiet_stdout()
        return 0
    except BaseException as err:  # noqa: BLE001 - every error ends in one line, not a traceback
        if debug_enabled():
            raise
        code, message = exit_code_and_message(err)
        print_error(message, console, label="interrupted" if code == EXIT_INTERRUPTED else "error")
        return code
    return 0 if result is None else int(result)


def quiet_stdout() -> None:
    """Point stdout at /dev/null after its reader has gone, so that the flush at exit does not
    raise BrokenPipeError again (Python prints that as "Exception ignored ...")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured in tests): nothing to flush
        pass
