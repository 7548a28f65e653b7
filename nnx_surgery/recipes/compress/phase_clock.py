"""`PhaseClock`: the wall time of each phase of a recipe run, over every command that worked on it.

A run on a machine that limits each command (a TPU lease's 10 minutes, a preemptible job) is finished by
`--resume` across commands. Each command's phases are kept in the run folder (`phase_times.json`, rewritten after
every phase): a resumed command adds its own, and the run's report gives each phase's time summed over the
commands, the number of commands and the time a stopped command spent in a phase it did not finish, so that the
times add up to the run's whole wall time.

Nothing is written before the command's first phase ends: until then the folder holds no run to resume, and a run
refused or failing there leaves its folder as it found it (empty folders it made are removed). A command that ends
before its first phase (a refusal, a kill) is not counted. The record is best effort: a write that fails (a full
disk) is skipped, so that the run's own error is the one reported.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

from nnx_surgery.surgery.storage.atomic import write_json

FILE = "phase_times.json"


class PhaseClock:
    """Wall time of each phase of this command, in order; with `keep_in`, also those of the run's earlier
    commands (`FILE` in the run folder)."""

    def __init__(self, start: float):
        self.start = start
        self.laps: dict[str, float] = {}
        self._last = start
        self._earlier: list[dict] = []
        self._path: str | None = None
        self._written = False  # this command's record is in the file (after its first phase)

    def keep_in(self, folder: str) -> None:
        """Read the earlier commands' phases from `folder` and write this command's there after each phase."""
        self._path = os.path.join(folder, FILE)
        if os.path.exists(self._path):
            with open(self._path) as handle:
                self._earlier = list(json.load(handle).get("commands", []))

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self._last, 1)
        self._last = now
        self._save()

    def stop(self) -> None:
        """The command ends (finished, stopped or failed): the time since its last phase is kept as unfinished
        (where the command has a record: it finished a phase)."""
        if self._written:
            self._save(stopping=True)

    def _record(self, stopping: bool = False) -> dict:
        now = time.time()
        record: dict = {"started": round(self.start, 1), "wall_s": round(now - self.start, 1), "laps": self.laps}
        if stopping:
            record["unfinished_s"] = round(now - self._last, 1)
        return record

    def _save(self, stopping: bool = False) -> None:
        if self._path is not None:
            with contextlib.suppress(OSError):  # best effort (module docstring)
                write_json(self._path, {"commands": [*self._earlier, self._record(stopping)]})
                self._written = True

    def totals(self) -> dict:
        """Each phase's seconds summed over the run's commands (this one included), in the order they first
        ran; the commands; the seconds stopped commands spent in phases they did not finish; the whole."""
        commands = [*self._earlier, self._record()]
        phases: dict[str, float] = {}
        for command in commands:
            for name, seconds in command["laps"].items():
                phases[name] = round(phases.get(name, 0.0) + seconds, 1)
        unfinished = round(sum(command.get("unfinished_s", 0.0) for command in self._earlier), 1)
        return {"phases": phases, "commands": len(commands), "unfinished_s": unfinished,
                "wall_s": round(sum(command["wall_s"] for command in commands), 1)}


def wall_time_line(results: dict) -> str:
    """results.md's line: each phase's wall time (over every command of a resumed run) and the whole."""
    times = results.get("phase_times_s") or {}
    if not times:
        return f"Wall time: {results['wall_time_s']:.0f} s."
    commands = results.get("commands", 1)
    where = f" over {commands} commands (resumed)" if commands > 1 else ""
    line = f"Wall time{where}: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items())
    if results.get("unfinished_s"):
        line += f", {results['unfinished_s']:.0f} s in phases a stopped command did not finish"
    return line + f"; {results['wall_time_s']:.0f} s in all."


__all__ = ["FILE", "PhaseClock", "wall_time_line"]
