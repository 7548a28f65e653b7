"""Stopping a distillation run on request without losing work: SIGINT (Ctrl-C) and SIGTERM (a scheduler's
preemption notice) handling, the error that says what was saved and how to resume, and the cleanup of checkpoint
writes that a killed run left unfinished.

A first signal lets the current step finish; the loop then checkpoints it and raises RunInterrupted. A second one
raises at once, even in the middle of that checkpoint write. Orbax writes a checkpoint into a temporary folder
(`<step>.orbax-checkpoint-tmp-<time>`) and renames it to `<step>` only when every item is written, so a write cut
short by a second signal, SIGKILL or a full disk is never taken for a checkpoint; `remove_unfinished_saves`
deletes such folders when the next run starts, and `drop_torn_line` the partial last line of its metrics log.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from typing import Any

import jax

UNFINISHED_SAVE = ".orbax-checkpoint-tmp"  # in the name of a checkpoint folder orbax has not finished writing
RESUME_HOW = "run the same call again (checkpoint.resume=True, the default; a recipe: the same command with --resume)"


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on SIGINT/SIGTERM. `step`: the last completed step; `checkpoint_step`: the step a resumed
    run continues from (None: nothing saved); `directory`: the checkpoint directory (None: none configured)."""

    def __init__(self, message: str, *, step: int, checkpoint_step: int | None, directory: str | None):
        super().__init__(message)
        self.step, self.checkpoint_step, self.directory = step, checkpoint_step, directory


def interruption_message(cause: str, step: int, total: int, *, saved: bool, directory: str | None,
                         checkpoint_step: int | None) -> str:
    what = (f"saved step {step} of {total}" if saved and directory is not None
            else f"stopped after step {step} of {total}" if directory is None
            else f"stopped at once after step {step} of {total}, before its checkpoint was complete")
    if directory is None:
        advice = ("no checkpoint directory is set, so nothing was saved (the student module holds the weights of "
                  "the last completed step).")
    elif checkpoint_step is None:
        advice = f"no complete checkpoint is in {directory} yet; {RESUME_HOW} to start over."
    else:
        advice = f"{RESUME_HOW} to continue from step {checkpoint_step} (checkpoint in {directory})."
    return f"{cause}: {what}; {advice}"


class StopSignals:
    """SIGINT and SIGTERM while the loop runs (main thread only; a signal the process ignores stays ignored): the
    first one is noted for the loop to act on at the next step boundary; a second raises KeyboardInterrupt at once.
    The previous handlers come back on exit. Not on multi-host runs: a checkpoint is written by every process
    together, and each would stop at its own step boundary, so there a signal keeps its default effect."""

    NAMES = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for name in self.NAMES:
                number = getattr(signal, name)
                previous = signal.getsignal(number)
                if previous is not signal.SIG_IGN:
                    self._previous[number] = signal.SIG_DFL if previous is None else previous
                    signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.received is not None:
            if redelivered_later(number, frame):
                return
            raise KeyboardInterrupt(f"{name} again")
        self.received = name
        print(f"\n{name}: finishing the current step, then saving a checkpoint and stopping (send it again to stop "
              "at once).", file=sys.stderr, flush=True)


# functions the interpreter calls where an exception cannot propagate (it is printed as "Exception ignored" and
# dropped): a garbage-collection callback (jax's), a finaliser, a weakref callback
NO_RAISE = ("_xla_gc_callback", "__del__", "_remove_dead_weakref", "_weakref_callback")


def redelivered_later(number: int, frame) -> bool:
    """Whether the signal `number` arrived inside a function that cannot raise (`NO_RAISE`; the frame and those
    calling it); then it is sent again 50 ms later, for the handler to raise where the exception propagates
    (raising there would lose it, or leave native code mid-call)."""
    while frame is not None:
        if frame.f_code.co_name in NO_RAISE:
            threading.Timer(0.05, os.kill, (os.getpid(), number)).start()
            return True
        frame = frame.f_back
    return False


def remove_unfinished_saves(directory: str) -> list[str]:
    """Delete the temporary folders of checkpoint writes that never completed (a killed run's); returns their
    names. Only process 0 deletes (the directory is shared storage on multi-host runs)."""
    if not os.path.isdir(directory) or jax.process_index() != 0:
        return []
    stale = sorted(name for name in os.listdir(directory) if UNFINISHED_SAVE in name)
    for name in stale:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return stale


def drop_torn_line(path: str) -> None:
    """A run killed while writing its JSONL log leaves a partial last line: cut it before this run appends."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        tail_start = max(0, size - (1 << 20))  # a record is far shorter than 1 MiB
        handle.seek(tail_start)
        tail = handle.read()
        if tail and not tail.endswith(b"\n"):
            handle.truncate(tail_start + tail.rfind(b"\n") + 1)


__all__ = ["RunInterrupted", "StopSignals", "redelivered_later", "interruption_message",
           "remove_unfinished_saves", "drop_torn_line",
           "UNFINISHED_SAVE"]
