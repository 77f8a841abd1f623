"""Cooperative cancellation of a running job.

When a commit makes a running job's result unacceptable, the coordinator cancels its attempt and the pool sets
that attempt's event. The pool runs each job inside `scope(event)`; the episode runner calls `check()` between
turns and stops there (closing its sandboxes) with `Cancelled`. Python cannot interrupt a thread, so a turn
in progress (a generation, a command) is finished first. The event lives in a context variable, so job
functions need no extra argument and code that never checks simply runs to the end (its result is then
counted as cancelled all the same).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator

_EVENTS: contextvars.ContextVar[tuple[threading.Event, ...]] = contextvars.ContextVar("asyncres_cancel", default=())


class Cancelled(Exception):
    """The job stopped early: a commit made its result unacceptable (too stale)."""


@contextlib.contextmanager
def scope(event: threading.Event) -> Iterator[threading.Event]:
    """Run the block as a job that `event` cancels (this thread only; threads it starts are not covered). Scopes
    nest: inside another scope, either event cancels the block."""
    token = _EVENTS.set(_EVENTS.get() + (event,))
    try:
        yield event
    finally:
        _EVENTS.reset(token)


def requested() -> bool:
    return any(event.is_set() for event in _EVENTS.get())


def check(what: str = "job") -> None:
    """Raise Cancelled if the current job was cancelled (call at a point where stopping is clean)."""
    if requested():
        raise Cancelled(f"{what} cancelled: its result can no longer be accepted")
