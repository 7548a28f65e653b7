"""Monitoring targets that act: each held-out evaluation checks the run against `DistillConfig.targets`.

Quality targets (held-out, temperature 1): `kl_below` (KL(teacher || student)), `correlation_above` (Pearson
correlation of teacher and student logits over the vocabulary), `perplexity_below` (the student's). Device targets:
`utilisation_above` (the fraction of the loop's wall time spent in the train step, against waiting on the data or
on host-side work) and `mfu_above` (model FLOPs utilisation, where the device's peak is known). Every evaluation
record gets `target/<name>` (1 met, 0 missed; absent when it cannot be measured yet) and the lists
`targets_met` / `targets_missed`; the run's summary (DistillResult.targets) is the last report.

`stop_when_met` ends the run at the first evaluation that meets every set quality target. Device targets never end
a run (training longer does not make it faster): when utilisation stays under its target, the run warns once with
the likely cause.

How the step / data / host split is measured (`StepTimes`): the loop already waits for every step's metrics (the
guard needs the loss), so no synchronisation is added. Per step it times the unoverlapped wait for the batch
iterator, the stretch from dispatching the step to receiving its metrics (during which the next batch is fetched),
and the rest of the iteration (schedule values, guard, logging). Right after the fetch the loop asks the step's
outputs whether they are ready (`jax.Array.is_ready`, which does not wait). When they are not, the device was busy
for the whole dispatch-to-metrics stretch: that is step time. When they are, the step ended while the next batch was
being fetched, and that fetch counts as data time (an upper bound on data time, so utilisation is never overstated).
Asking the arrays is exact; timing the metrics fetch instead (a slow fetch meaning a busy device) misreads a loaded
host, where even a finished step's fetch can take milliseconds. Steps that include a compilation (the first of a
stage) and the time of evaluations and checkpoints are left out.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# name -> (metric of the evaluation record, True when the value must stay below the threshold)
TARGETS = {"kl_below": ("kl", True), "correlation_above": ("logit_corr", False),
           "perplexity_below": ("perplexity", True), "utilisation_above": ("utilisation", False),
           "mfu_above": ("mfu", False)}
QUALITY_TARGETS = ("kl_below", "correlation_above", "perplexity_below")
MIN_STEPS_TO_WARN = 4  # measured steps before a low utilisation is reported

def check_targets(targets: Any, values: Mapping[str, float | None]) -> dict[str, dict[str, Any]]:
    """Per set target: {"metric", "value", "threshold", "met"}; `met` is None when the value is not measured."""
    report = {}
    for name, (metric, below) in TARGETS.items():
        threshold = getattr(targets, name, None)
        if threshold is None:
            continue
        value = values.get(metric)
        measured = value is not None and math.isfinite(value)
        met = None if not measured else bool(value < threshold if below else value > threshold)
        report[name] = {"metric": metric, "value": value, "threshold": float(threshold), "met": met}
    return report


def quality_met(report: Mapping[str, Mapping[str, Any]]) -> bool:
    """Every set quality target measured and met (False when none is set)."""
    quality = [report[name]["met"] for name in QUALITY_TARGETS if name in report]
    return bool(quality) and all(met is True for met in quality)


def record_fields(report: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The evaluation record's fields: `target/<name>` as 1/0 where measured, and the met / missed lists."""
    fields: dict[str, Any] = {f"target/{name}": float(entry["met"]) for name, entry in report.items()
                              if entry["met"] is not None}
    fields["targets_met"] = [name for name, entry in report.items() if entry["met"] is True]
    fields["targets_missed"] = [name for name, entry in report.items() if entry["met"] is False]
    return fields


def report_line(step: int, report: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for the terminal: each target's value, threshold and whether it is met."""
    parts = []
    for name, entry in report.items():
        sign = "<" if TARGETS[name][1] else ">"
        if entry["met"] is None:
            parts.append(f"{entry['metric']} {sign} {entry['threshold']:g} not measured")
        else:
            parts.append(f"{entry['metric']} {entry['value']:.4g} {sign} {entry['threshold']:g} "
                         f"{'met' if entry['met'] else 'MISSED'}")
    met = sum(1 for entry in report.values() if entry["met"])
    return f"targets @ step {step} ({met}/{len(report)} met): " + "; ".join(parts)


@dataclasses.dataclass
class StepTimes:
    """Seconds of loop wall time spent in train steps, waiting on the batch iterator, and in host-side work
    between steps (see the module docstring), with the MFU of each step where known."""

    step: float = 0.0
    data: float = 0.0
    host: float = 0.0
    steps: int = 0
    mfu_sum: float = 0.0
    mfu_steps: int = 0

    def add(self, step_s: float, data_s: float, host_s: float, mfu: float | None = None) -> None:
        self.step, self.data, self.host = self.step + step_s, self.data + data_s, self.host + max(host_s, 0.0)
        self.steps += 1
        if mfu is not None:
            self.mfu_sum, self.mfu_steps = self.mfu_sum + mfu, self.mfu_steps + 1

    def fractions(self) -> dict[str, float] | None:
        """{"utilisation", "data_fraction", "host_fraction", "mfu"?}; None before any measured step."""
        total = self.step + self.data + self.host
        if not self.steps or total <= 0:
            return None
        out = {"utilisation": self.step / total, "data_fraction": self.data / total,
               "host_fraction": self.host / total}
        if self.mfu_steps:
            out["mfu"] = self.mfu_sum / self.mfu_steps
        return out

    def state(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def split_step(dispatch_to_metrics_s: float, overlapped_fetch_s: float, busy_after_fetch: bool,
               unoverlapped_fetch_s: float) -> tuple[float, float]:
    """(step seconds, data seconds) of one iteration; `busy_after_fetch`: the step's outputs were not ready when the
    overlapped fetch of the next batch ended (module docstring)."""
    if busy_after_fetch:
        return dispatch_to_metrics_s, unoverlapped_fetch_s
    return max(dispatch_to_metrics_s - overlapped_fetch_s, 0.0), unoverlapped_fetch_s + overlapped_fetch_s


def low_utilisation_cause(fractions: Mapping[str, float]) -> str:
    """The likely cause of a low utilisation, and what to do about it."""
    data, host = fractions["data_fraction"], fractions["host_fraction"]
    if data >= host:
        return (f"data-bound: {data:.0%} of the loop's time is spent waiting on the batch iterator; make batches "
                "faster or ahead of time (pre-tokenised data, a faster tokenizer, a background loader), or do more "
                "work per step (larger batches, more gradient accumulation).")
    return (f"host-bound: {host:.0%} of the loop's time is host-side work between steps (Python overhead, "
            "logging, small transfers); do more work per step (larger batches, more gradient accumulation) or "
            "turn off per-step extras (progress=False, train_diagnostics=False).")


class TargetMonitor:
    """The targets' collaborator of the training loop: the step timing (the whole run, and the window since the
    last evaluation), each evaluation's report, the low-utilisation warning (given once) and the first
    announcement that the quality targets are met. State: `times`, `window`, `report` (the last evaluation's),
    `warned`, `announced`."""

    def __init__(self, targets: Any):
        self.targets = targets
        self.report: dict[str, dict[str, Any]] = {}
        self.times, self.window = StepTimes(), StepTimes()
        self.warned = False
        self.announced = False

    def time(self, step_s: float, data_s: float, host_s: float, mfu: float | None) -> None:
        for times in (self.times, self.window):
            times.add(step_s, data_s, host_s, mfu)

    def evaluate(self, record: dict[str, Any]) -> None:
        """Add the window's utilisation and the targets' fields to an evaluation record (the window restarts)."""
        record.update(self.window.fractions() or {})
        self.window = StepTimes()
        self.report = check_targets(self.targets, record)
        record.update(record_fields(self.report))

    def utilisation_warning(self) -> tuple[str, dict[str, Any]] | None:
        """(message, fields) once, when the run's utilisation so far is under its target; else None."""
        target, fractions = getattr(self.targets, "utilisation_above", None), self.times.fractions()
        if (target is None or not self.targets.warn_low_utilisation or self.warned or not fractions
                or self.times.steps < MIN_STEPS_TO_WARN or fractions["utilisation"] >= target):
            return None
        self.warned = True
        cause = low_utilisation_cause(fractions)
        return (f"LOW UTILISATION: {fractions['utilisation']:.0%} of the loop's time is in the train step (target "
                f"{target:.0%}); likely {cause}",
                dict(reason=cause.split(":")[0], utilisation=fractions["utilisation"],
                     data_fraction=fractions["data_fraction"], host_fraction=fractions["host_fraction"]))

    def met(self, step: int) -> tuple[bool, tuple[str, dict[str, Any]] | None]:
        """(every set quality target met, the (message, fields) announcing it the first time)."""
        if not quality_met(self.report):
            return False, None
        if self.announced:
            return True, None
        self.announced = True
        met = [name for name in QUALITY_TARGETS if name in self.report]
        return True, (f"targets met at step {step}: {', '.join(met)}", dict(reason="targets met", targets=met))

    def summary(self, step: int, stopped_early: bool) -> dict[str, Any]:
        """The run's summary: steps, whether the targets ended it, the last targets met / missed, utilisation."""
        fields = record_fields(self.report)
        return {"steps": step, "stopped_early": stopped_early, "targets_met": fields["targets_met"],
                "targets_missed": fields["targets_missed"], **(self.times.fractions() or {})}


__all__ = ["TargetMonitor", "TARGETS", "QUALITY_TARGETS", "check_targets", "quality_met", "record_fields",
           "report_line", "StepTimes", "split_step", "low_utilisation_cause"]
