"""The step loop of `distill.run`: stages, schedule values, logging and evaluation, composed with collaborators
that each hold their own state and that the loop calls: the divergence guard (guard.py), the fallbacks
(fallbacks.py), the checkpoints (checkpointing.RunCheckpoints), the out-of-memory retries (oom.MemoryRetries)
and the target monitor (targets.TargetMonitor).

Divergence guard: a divergent step (guard.py) triggers a rollback to the last good state (the latest checkpoint,
or an in-memory copy taken at the same cadence when no checkpoint directory is set) and a learning-rate backoff.
The data stream is not rewound: the batches around the divergence are skipped. The in-memory copy holds the
student and its Adam state on the host (about 3x the trainable size in float32): set a checkpoint directory for
big models.
`GuardConfig.policies` adds fallbacks (fallbacks.py: `switch_to_mse` after a divergence, `sft_then_mix` when the
held-out cross-entropy gets worse than at the stage's start); they change traced loss weights only.

Each evaluation checks `DistillConfig.targets` (target_monitor.py) and may end the run (`stop_when_met`); the loop times
its steps against the waits on data and host work where it already waits for the step's metrics (no added sync).
An out-of-memory error while compiling or dispatching the step is retried with less memory (oom.py).

Interruption: a first SIGINT (Ctrl-C) or SIGTERM lets the current step finish, checkpoints it (when a checkpoint
directory is set) and raises RunInterrupted, which says which step was saved and how to resume; a second one stops
at once, even in the middle of that checkpoint write. Orbax writes a checkpoint into a temporary folder and renames
it when complete, so a write cut short (a second signal, SIGKILL, a full disk) is never resumed from, and the next
run removes its leftovers. A checkpoint's `meta` also holds the step records, evaluations and events so far, so a
resumed run reports the whole history (DistillResult.full_history).
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import freeze, target_monitor as targets
from ..losses import term_registry as terms
from .checkpointing import RunCheckpoints, by_step
from .run_config import DistillConfig
from .fallbacks import DivergenceError, Fallbacks
from .guard import DivergenceGuard
from ..interruption import RunInterrupted, StopSignals, drop_torn_line, interruption_message
from .feed import BatchFeed, processes
from .feed import stack_batches as _stack  # noqa: F401 - tests import it from here
from ..mesh import put_batch
from .metrics import MetricsLogger, device_peak_flops, make_logger, step_flops
from .on_policy import OnPolicy
from .oom import MemoryRetries
from .train_step import hyper_values


def _ready(values: dict[str, Any]) -> bool:
    """Whether the step that produced `values` has finished; never waits."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(values) if hasattr(leaf, "is_ready"))


def _host(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(values).items()}


class TrainingLoop:
    """Drives a run: which stage and step come next, their schedule values, logging and evaluations. The student's
    training state lives in `runner` (a StepRunner); the loop owns the run's position and records (step, data
    position, history, evaluations, events) and calls its collaborators, each with its own state: `guard`
    (DivergenceGuard), `fallbacks` (Fallbacks), `checkpoints` (RunCheckpoints), `memory` (MemoryRetries) and
    `monitor` (TargetMonitor)."""

    def __init__(self, runner, data, config: DistillConfig, mesh, eval_data, teacher, student, sampler=None):
        self.runner, self.data, self.config, self.mesh = runner, data, config, mesh
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.resumed_history: list[dict[str, Any]] = []  # records of steps done before this call (from `meta`)
        self.resumed_evals: list[dict[str, Any]] = []
        self.resumed_events: list[dict[str, Any]] = []
        self.stop = StopSignals()
        self.eval_batches = [put_batch({k: np.asarray(v) for k, v in b.items()}, mesh)
                             for b in data.eval_batches(eval_data, config.eval_batches)]
        self.teacher, self.student = teacher, student
        self.peak = device_peak_flops(config.peak_flops)
        self.devices = mesh.size if mesh is not None else 1
        self.flops: float | None = None
        self.logger: MetricsLogger | None = None
        self._last_eval_step = -1
        self.data_state = data.state()  # position after the last completed step
        self.guard = DivergenceGuard(config.guard)
        self.fallbacks = Fallbacks(config.guard, teacher is not None,
                                   terms.option_values(terms.term("mse"), config)["on"])
        if self.fallbacks.uses("sft_then_mix") and not (self.eval_batches and config.eval_every):
            raise ValueError("GuardConfig.policies 'sft_then_mix' acts on held-out evaluations: pass eval_data (or "
                             "data with eval_batches()) and set eval_every.")
        self.checkpoints = RunCheckpoints(config, runner)
        # rows of this process's data batch (micro-batches may be split): config.json after OOM decisions
        rows = config.batch_size and config.batch_size // processes(mesh)
        self.memory = MemoryRetries(config, runner, mesh, rows, self._event, self._restore_last_good)
        self.monitor = targets.TargetMonitor(config.targets)
        self.stopped_early = False
        self.on_policy = OnPolicy(config.on_policy, sampler, config.seed) if config.on_policy.fraction else None
        self.feed = BatchFeed(data, config, mesh, self.memory, self.on_policy)

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> None:
        """The loop under StopSignals: a first signal stops it after a checkpoint of the last completed step; a
        second, or one arriving while that checkpoint is written, stops it at once (RunInterrupted either way)."""
        with self.stop:
            try:
                self._run()
                self._stop_if_asked()  # a signal during the last step or evaluation: the run is complete, stop
            except KeyboardInterrupt as error:
                if isinstance(error, RunInterrupted) or self.stop.received is None:
                    raise
                raise self._interrupted(str(error) or self.stop.received, saved=False) from None

    def _open_logs(self) -> None:
        """The metrics logger from the current step (a line torn by an earlier kill cut), and config.json."""
        config = self.config
        if config.run_dir and jax.process_index() == 0:
            drop_torn_line(os.path.join(config.run_dir, "metrics.jsonl"))
        self.logger = make_logger(config, config.run_dir, start_step=self.step)  # JSONL, TensorBoard, bar, W&B
        self.memory.write_config()

    def _start(self) -> bool:
        """Resume or enter the first stage, open the logs, report what happened before; the evaluation of the
        starting point. Returns whether the run should stop there (targets met)."""
        resumed = self._resume()
        if not resumed:
            self._enter(self.config.stage_at(0)[0], carry=False)
        self._open_logs()
        stale = self.checkpoints.stale_saves
        if stale:
            self._event("cleanup", f"removed {len(stale)} unfinished checkpoint write(s) of an earlier run: "
                                   f"{', '.join(stale)}")
        for note in self.checkpoints.skipped:
            self._event("checkpoint_unreadable", note)
        if resumed:
            self._event("resume", f"resumed from step {self.step} (stage {self.runner.stage_index}) in "
                                  f"{self.checkpoints.directory}")
            return self._eval_due() and self._evaluate()  # stopped between this checkpoint and its evaluation
        self._event("stage", self._stage_line(self.runner.stage_index, 0), stage=self.runner.stage_index,
                    carried=0)
        if self.on_policy is not None:
            self._event("on_policy", self.on_policy.describe(), fraction=self.config.on_policy.fraction)
        self._mark_good()
        return self._evaluate()

    def _run(self) -> None:
        config = self.config
        if self._start():
            return self._stop_early()
        last_step = min(config.total_steps, config.halt_after or config.total_steps)
        prefetched, self._clock = None, time.perf_counter()
        while self.step < config.total_steps:
            self._stop_if_asked()
            index, in_stage = config.stage_at(self.step)
            if index != self.runner.stage_index and self._switch_stage(index):
                return self._stop_early()
            fetch_start = time.perf_counter()
            batch, self.data_state, host, digest = prefetched or self.feed.next()
            fetch_s = time.perf_counter() - fetch_start
            # host time: sampling waits on the previous step
            batch, policy = self.feed.for_step(batch, host, self.step, self.runner.current_student)
            hyper, active = self._hyper(index, in_stage)
            started = time.perf_counter()
            dispatched = self.memory.dispatch(batch, hyper, self.step)
            if dispatched is None:  # out of memory after the step consumed its state: restored, batch skipped
                prefetched, self._clock = None, time.perf_counter()
                continue
            batch, pending, warmup = dispatched
            prefetch_start = time.perf_counter()
            prefetched = self.feed.next() if self.step + 1 < last_step else None  # host work overlaps the step
            wait_start, busy = time.perf_counter(), not _ready(pending)
            values = _host(pending)
            done = time.perf_counter()
            reason = self.guard.divergence(values, self.step)
            if reason:
                self._rollback(reason, values)
                self._clock = time.perf_counter()
                continue
            self.step += 1
            self.guard.record(values["loss"])
            record = self._log_step(values, hyper, done - started, index, batch, warmup, active,
                                   dict(policy, batch_digest=digest))
            step_s, data_s = targets.split_step(done - started, wait_start - prefetch_start, busy, fetch_s)
            if not warmup:
                self.monitor.time(step_s, data_s, time.perf_counter() - self._clock - step_s - data_s,
                                  record.get("mfu"))
            self._fallback(self.fallbacks.on_step(self.step))
            outcome = self._after_step()
            if outcome == "halt":
                return None
            if outcome == "targets":
                return self._stop_early()
            self._clock = time.perf_counter()
        if self._last_eval_step != self.step and self._evaluate():
            self._stop_early()

    def _after_step(self) -> str | None:
        """Checkpoint, evaluation and halt after a completed step: "targets" when the targets end the run, "halt"
        at `halt_after`."""
        config = self.config
        if self.step % config.checkpoint.every == 0 or self.step == config.total_steps:
            self._mark_good()
        if self._eval_due() and self._evaluate():
            return "targets"
        if config.halt_after is not None and self.step >= config.halt_after:
            self._mark_good()
            self._event("halt", f"halted after step {self.step} (halt_after={config.halt_after})")
            return "halt"
        return None

    def close(self) -> None:
        if self.logger is not None:
            self.logger.summary(self.monitor.summary(self.step, self.stopped_early))  # W&B: targets, utilisation
            self.logger.close()  # also draws the curves
        self.checkpoints.close()

    # ------------------------------------------------------------------------------------------ pieces
    def _enter(self, index: int, *, carry: bool) -> int:
        return self.runner.enter_stage(index, carry=carry)

    def _switch_stage(self, index: int) -> bool:
        """Enter stage `index` (carrying matching optimizer state); True when an evaluation there meets the
        targets (sft_then_mix evaluates at each stage's start: its baseline)."""
        carried = self._enter(index, carry=True)
        self.guard.restart_history()  # the loss scale changes with the weights
        self._event("stage", self._stage_line(index, carried), stage=index, carried=carried)
        evals = self.resumed_evals + self.evals
        self._fallback(self.fallbacks.on_stage(index, evals[-1] if evals and evals[-1]["step"] == self.step
                                               else None))
        return self.fallbacks.uses("sft_then_mix") and self._eval_due(stage_start=True) and self._evaluate()

    def _stage_line(self, index: int, carried: int) -> str:
        stage, runner = self.config.stages[index], self.runner
        counts = freeze.describe_split(runner.params["student"], runner.frozen)
        active = {k: v for k, v in stage.weights.to_dict().items() if v}  # ramps as [start, end]
        return (f"stage {index}{' (' + stage.name + ')' if stage.name else ''}: {stage.steps} steps, "
                f"{counts['trainable']:,} trainable / {counts['frozen']:,} frozen parameters, lr "
                f"{stage.learning_rate:g}, weights {active}, temperature {stage.temperature.start:g}->"
                f"{stage.temperature.end:g}; carried {carried} optimizer-state leaves")

    def _opened_logger(self) -> MetricsLogger:
        """The metrics logger, which `_open_logs` makes before the first step or evaluation."""
        if self.logger is None:
            raise RuntimeError("the metrics logger is not open yet (TrainingLoop._open_logs makes it).")
        return self.logger

    def _event(self, kind: str, message: str, **fields: Any) -> None:
        record = {"event": kind, "step": self.step, "message": message, **fields}
        self.events.append(record)
        self._opened_logger().message(message, event=kind, step=self.step, **fields)

    def _fallback(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Report the fallbacks' switches; each changes the loss weights, so the guard's loss history restarts."""
        for message, fields in events:
            self._event("fallback", message, **fields)
            self.guard.restart_history()

    def _hyper(self, index: int, in_stage: int) -> tuple[dict[str, Any], list[str]]:
        """The step's traced hyperparameters, with the loss weights the active fallbacks set."""
        stage = self.config.stages[index]
        hyper = hyper_values(stage, in_stage, self.config.optimizer.weight_decay, self.guard.lr_scale)
        if not self.fallbacks.active:
            return hyper, []
        weights, active = self.fallbacks.weights(stage.weights_at(in_stage), self.step)  # host values, no sync
        hyper.update({name: jnp.asarray(weights[name], jnp.float32) for name in terms.weight_names()})
        return hyper, active

    def _log_step(self, values, hyper, elapsed: float, index: int, batch, warmup: bool, active: list[str],
                  policy: dict[str, float | str]):
        accum, batch_size, seq_len = batch["input_ids"].shape
        tokens = accum * batch_size * seq_len
        if self.flops is None:
            self.flops = step_flops(self.student, self.teacher, tokens, seq_len)
        record = {"step": self.step, "stage": index, **values, "perplexity": math.exp(min(values["student_ce"], 80)),
                  "lr": float(hyper["lr"]), "temperature": float(hyper["temperature"]), "step_time_s": elapsed,
                  "tokens_per_s": tokens / elapsed, "tflops_per_s": self.flops / elapsed / 1e12, **policy}
        if warmup:
            record["warmup"] = True  # first step of a stage or after an OOM decision: may include compilation
        record.update(self.runner.take_compile_report())  # compile_s and XLA's bytes, at the step that compiled
        if self.peak:
            record["mfu"] = self.flops / (elapsed * self.devices * self.peak)
        if active:  # a fallback sets the loss weights
            record["fallback"] = ",".join(active)
            record.update({f"weight/{name}": float(hyper[name]) for name in self.fallbacks.moved_weights})
        self.history.append(record)
        self._opened_logger().step(record)
        return record

    def _eval_due(self, stage_start: bool = False) -> bool:
        """An evaluation at this step not done yet: at step 0 (before training), every `eval_every` steps, and
        (`stage_start`) at a stage's start."""
        every = self.config.eval_every
        due = stage_start or self.step == 0 or bool(every) and self.step % every == 0
        return due and self._last_eval_step != self.step

    def _evaluate(self) -> bool:
        """Held-out metrics, the targets' report and the actions they take; True when the run should stop."""
        if not self.eval_batches:
            return False
        totals: dict[str, float] = {}
        count = 0.0
        for batch in self.eval_batches:
            values = _host(self.runner.evaluate(batch))
            tokens = values.pop("supervised_tokens")
            count += tokens
            for key, value in values.items():
                totals[key] = totals.get(key, 0.0) + value * tokens
        record = {"step": self.step, "eval": True, **{k: v / count for k, v in totals.items()}}
        record["perplexity"] = math.exp(min(record["student_ce"], 80))
        self.monitor.evaluate(record)
        self.evals.append(record)
        self._opened_logger().evaluation(record)
        self._last_eval_step = self.step
        if self.monitor.report:
            self._opened_logger().message(targets.report_line(self.step, self.monitor.report))
        self._fallback(self.fallbacks.on_evaluation(self.step, self.runner.stage_index, record))
        warning = self.monitor.utilisation_warning()
        if warning:
            self._event("low_utilisation", warning[0], **warning[1])
        met, announcement = self.monitor.met(self.step)
        if announcement:
            self._event("targets_met", announcement[0], **announcement[1])
        return met and bool(self.config.targets.stop_when_met)

    # ------------------------------------------------------------------------------------------ guard, checkpoints
    def _rollback(self, reason: str, values: dict[str, float]) -> None:
        guard = self.config.guard
        failed_step = self.step + 1
        self.guard.count_rollback(failed_step, reason)
        restored = self._restore_last_good()
        self.guard.back_off()
        if self.logger is not None:
            self.logger.rewind(self.step)
        lr_scale, rollbacks = self.guard.lr_scale, self.guard.rollbacks
        self._event("rollback", f"DIVERGENCE at step {failed_step}: {reason}. Rolled back to step {restored} and "
                                f"scaled the learning rate by {guard.lr_backoff:g} (now x{lr_scale:g}); "
                                f"rollback {rollbacks} of {guard.max_rollbacks}.",
                    failed_step=failed_step, restored_step=restored, lr_scale=lr_scale, reason=reason)
        self._fallback(self.fallbacks.on_divergence(restored, reason))

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the model state: the run's position, the collaborators' state and
        the records so far."""
        return {"step": self.step, "stage": self.runner.stage_index, "data_state": self.data_state,
                **self.guard.state(), "seed": self.config.seed, "total_steps": self.config.total_steps,
                "fallbacks": self.fallbacks.state(), "oom": self.memory.state(),
                "history": by_step(self.resumed_history + self.history, self.step),
                "evals": by_step(self.resumed_evals + self.evals, self.step),
                "events": [e for e in self.resumed_events + self.events if e["step"] <= self.step]}

    def _mark_good(self) -> None:
        self.checkpoints.mark_good(self.step, self._meta)

    def _restore_last_good(self) -> int:
        self.step = self.checkpoints.restore_last_good()
        return self.step

    def _resume(self) -> bool:
        """Continue from the newest readable checkpoint: the model state, then the run's position, records and
        the collaborators' state from its `meta`."""
        meta = self.checkpoints.resume()
        if meta is None:
            return False
        self.step = int(meta["step"])
        self.data.restore(meta["data_state"])
        self.data_state = meta["data_state"]
        self.guard.restore(meta)
        self.fallbacks.restore(meta.get("fallbacks"))
        self.resumed_history, self.resumed_evals = list(meta.get("history", [])), list(meta.get("evals", []))
        self.resumed_events = list(meta.get("events", []))
        self._last_eval_step = max((r["step"] for r in self.resumed_evals), default=-1)
        self.memory.restore(meta.get("oom"))
        return True

    def _stop_early(self) -> None:
        """End the run here (stop_when_met): checkpoint and report."""
        self.stopped_early = True
        self._mark_good()
        self._event("stop", f"stopped at step {self.step} of {self.config.total_steps}: every set quality target "
                            "is met (stop_when_met)", reason="targets met")

    # ------------------------------------------------------------------------------------------ interruption
    def _stop_if_asked(self) -> None:
        """After a first SIGINT/SIGTERM: checkpoint the last completed step (when a directory is set) and raise
        RunInterrupted. A second signal during that write abandons it (orbax never finalises it)."""
        if self.stop.received is None:
            return
        saved = self.checkpoints.directory is not None
        if saved:
            self._mark_good()
        raise self._interrupted(self.stop.received, saved=saved)

    def _interrupted(self, cause: str, *, saved: bool) -> RunInterrupted:
        where = self.checkpoints.directory
        latest = None if where is None else self.step if saved else self.checkpoints.latest_complete_step()
        message = interruption_message(cause, self.step, self.config.total_steps, saved=saved, directory=where,
                                       checkpoint_step=latest)
        if self.logger is not None:
            self._event("interrupt", message, checkpoint_step=latest)
        return RunInterrupted(message, step=self.step, checkpoint_step=latest, directory=where)


__all__ = ["TrainingLoop", "DivergenceError"]
