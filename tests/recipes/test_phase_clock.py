"""PhaseClock (recipes/compress/phase_clock.py): each phase's wall time over every command of a resumed run, kept in the
run folder after each phase, and results.md's line made from it."""
from __future__ import annotations

import json

from nnx_surgery.recipes.compress import phase_clock
from nnx_surgery.recipes.compress.phase_clock import PhaseClock, wall_time_line


def _command(folder, start: float, laps: list[tuple[str, float]], monkeypatch, *, stop_at: float | None = None):
    """A command whose phases end at the given seconds after `start` (time.time() made to say so)."""
    now = [start]
    monkeypatch.setattr(phase_clock.time, "time", lambda: now[0])
    clock = PhaseClock(start)
    clock.keep_in(str(folder))
    for name, at in laps:
        now[0] = start + at
        clock.lap(name)
    if stop_at is not None:
        now[0] = start + stop_at
        clock.stop()
    return clock


def test_a_resumed_run_counts_every_commands_phases(tmp_path, monkeypatch):
    # the first command loads, cuts and distils, then is stopped 200 s into the evaluation
    _command(tmp_path, 1000.0, [("teacher and data", 30), ("surgery", 55), ("distillation", 215)], monkeypatch,
             stop_at=415)
    saved = json.loads((tmp_path / phase_clock.FILE).read_text())["commands"]
    assert saved == [{"started": 1000.0, "wall_s": 415.0, "unfinished_s": 200.0,
                      "laps": {"teacher and data": 30.0, "surgery": 25.0, "distillation": 160.0}}]
    # the resumed one loads again, finds the distillation done, evaluates
    clock = _command(tmp_path, 2000.0, [("teacher and data", 28), ("surgery", 54), ("distillation", 54.5),
                                        ("evaluation", 290)], monkeypatch)
    totals = clock.totals()
    assert totals == {"phases": {"teacher and data": 58.0, "surgery": 51.0, "distillation": 160.5,
                                 "evaluation": 235.5},
                      "commands": 2, "unfinished_s": 200.0, "wall_s": 705.0}
    assert sum(totals["phases"].values()) + totals["unfinished_s"] == totals["wall_s"]
    line = wall_time_line({"phase_times_s": totals["phases"], "wall_time_s": totals["wall_s"],
                           "commands": totals["commands"], "unfinished_s": totals["unfinished_s"]})
    assert line == ("Wall time over 2 commands (resumed): teacher and data 58 s, surgery 51 s, distillation 160 s, "
                    "evaluation 236 s, 200 s in phases a stopped command did not finish; 705 s in all.")


def test_nothing_is_written_before_the_first_phase_ends(tmp_path, monkeypatch):
    """A command refused or failing before its first phase leaves the run folder as it found it."""
    _command(tmp_path, 5.0, [], monkeypatch, stop_at=3)
    assert not (tmp_path / phase_clock.FILE).exists()
    _command(tmp_path, 10.0, [("teacher and data", 2)], monkeypatch, stop_at=4)
    assert json.loads((tmp_path / phase_clock.FILE).read_text())["commands"][0]["unfinished_s"] == 2.0


def test_a_write_that_fails_leaves_the_runs_own_error_to_report(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(phase_clock, "write_json", full_disk)
    clock = _command(tmp_path, 1.0, [("teacher and data", 2)], monkeypatch, stop_at=3)  # no error raised
    assert clock.totals()["phases"] == {"teacher and data": 2.0}


def test_a_run_in_one_command_reads_as_before(tmp_path, monkeypatch):
    clock = _command(tmp_path, 10.0, [("teacher and data", 5), ("evaluation", 12)], monkeypatch)
    totals = clock.totals()
    assert totals["commands"] == 1 and totals["unfinished_s"] == 0
    assert wall_time_line({"phase_times_s": totals["phases"], "wall_time_s": totals["wall_s"], "commands": 1,
                           "unfinished_s": 0.0}) == "Wall time: teacher and data 5 s, evaluation 7 s; 12 s in all."
    assert wall_time_line({"wall_time_s": 3.0}) == "Wall time: 3 s."  # an older results.json
