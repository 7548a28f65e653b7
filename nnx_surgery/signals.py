"""How a command stops on Ctrl-C and SIGTERM (`refusals.guarded` uses it): the signal raises `KeyboardInterrupt`
(SIGINT) or `Terminated` (SIGTERM) in the main thread, so that `finally` blocks and temporaries' cleanup run, but
never inside a function where the exception would be dropped (a garbage-collection callback: the signal is sent
again a moment later); once the command is stopping, further signals are ignored, and a command in a process of
its own ends without the interpreter's shutdown (`exit_now`). distill's StopSignals takes over while it trains.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

from nnx_surgery.distill.interruption import redelivered_later
from nnx_surgery.surgery.storage.shared_writes import multi_host

OWN_PROCESS = [False]  # set by the installed command (cli.main with no argv): its own process
_ignored: dict[int, object] = {}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that `finally` blocks and temporaries' cleanup run."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (`sigterm`) stopped a command that says itself what it left (`advice`)."""

    def __init__(self, advice: str, *, sigterm: bool = False):
        super().__init__(advice)
        self.advice, self.sigterm = advice, sigterm


def by_sigterm(stop: BaseException) -> bool:
    """SIGTERM stopped the command: `Terminated`, distill's RunInterrupted naming it, or a `Stopped` after it."""
    return isinstance(stop, Terminated) or bool(getattr(stop, "sigterm", False)) or (
        isinstance(stop, KeyboardInterrupt) and str(stop).startswith("SIGTERM"))


@contextlib.contextmanager
def raised_in_main_thread() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and SIGTERM `Terminated` while the block runs, where they can propagate
    (elsewhere the handlers are left as they are; a signal the process ignores stays ignored; on a multi-host run
    SIGTERM keeps its default effect, as distill.interruption.StopSignals leaves it there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number, frame):
        if redelivered_later(number, frame):
            return
        if number == signal.SIGINT:
            raise KeyboardInterrupt
        if multi_host():  # one process of several stops as before (its default effect), for the others to see
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated("SIGTERM")

    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            if signal.getsignal(number) is stop:
                signal.signal(number, handler)  # type: ignore[arg-type]
            elif number in _ignored:  # stopping has set it ignored: `exit_now` puts this one back
                _ignored[number] = handler


def ignore_signals() -> None:
    """Ignore SIGINT and SIGTERM from now on: the command is stopping (`exit_now` puts the handlers back)."""
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            _ignored.setdefault(number, signal.signal(number, signal.SIG_IGN))


def exit_now(code: int, *, own_process: bool = False) -> None:
    """Exit with `code` once stdout and stderr are flushed. In a process of its own (the installed command, a
    recipe's script): without the interpreter's shutdown, which after Ctrl-C or SIGTERM would tear the runtime down
    under the accelerator's threads (a segmentation fault instead of the exit code). In a caller's process
    (`cli.main([...])`, the tests) it raises SystemExit and puts the signal handlers back."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if own_process or OWN_PROCESS[0]:
        os._exit(code)
    for number, previous in list(_ignored.items()):
        signal.signal(number, previous)  # type: ignore[arg-type]
        del _ignored[number]
    sys.exit(code)


__all__ = ["Terminated", "Stopped", "by_sigterm", "raised_in_main_thread", "ignore_signals", "exit_now",
           "OWN_PROCESS"]
