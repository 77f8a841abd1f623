"""One exception type for mistakes a user can fix, and the CLI wrapper that prints it as one line."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and how to fix it."""


def cli_main(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI main so a UserError ends the process with one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper
