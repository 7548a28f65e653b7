"""The step loop of `distill.run`: stages, logging, the divergence guard, checkpoints, resume and evaluation.

Divergence guard: a step whose loss or gradient norm is not finite (the step itself then leaves the parameters
unchanged) or whose loss exceeds `spike_factor` x the running median of recent good steps triggers a rollback to
the last good state (the latest checkpoint, or an in-memory copy taken at the same cadence when no checkpoint
directory is set) and multiplies the learning rate by `lr_backoff`. The data stream is not rewound: the batches
around the divergence are skipped. After `max_rollbacks` the run stops with DivergenceError; with the guard
disabled a non-finite loss stops the run at once. It never continues on NaNs. The in-memory copy holds the student
and its Adam state on the host (about 3x the trainable size in float32): set a checkpoint directory for big models.

Interruption: a first SIGINT (Ctrl-C) or SIGTERM lets the current step finish, checkpoints it (when a checkpoint
directory is set) and raises RunInterrupted, which says which step was saved and how to resume; a second one stops
at once, even in the middle of that checkpoint write. Orbax writes a checkpoint into a temporary folder and renames
it when complete, so a write cut short (a second signal, SIGKILL, a full disk) is never resumed from, and the next
run removes its leftovers. A checkpoint's `meta` also holds the step records and evaluations so far, so a resumed
run reports the whole history (DistillResult.full_history).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any, Mapping

import jax
import numpy as np

from . import freeze
from .checkpointing import Checkpointer
from .config import DistillConfig
from .interface import FORWARD_KEYS
from .interruption import RunInterrupted, StopSignals, drop_torn_line, interruption_message, remove_unfinished_saves
from .mesh import put_batch
from .metrics import MetricsLogger, device_peak_flops, plot_history, step_flops
from .step import hyper_values


class DivergenceError(RuntimeError):
    """The loss kept diverging after the configured number of rollbacks."""


def _stack(batches: list[dict[str, Any]], config: DistillConfig) -> dict[str, np.ndarray]:
    keys = set(batches[0])
    if "input_ids" not in keys:
        raise KeyError(f"a batch needs 'input_ids' (B, T) int32; it has {sorted(keys)}.")
    stacked = {key: np.stack([np.asarray(b[key]) for b in batches])
               for key in ("input_ids", "loss_mask", *FORWARD_KEYS) if key in keys}
    shape = stacked["input_ids"].shape[1:]
    expected = (config.batch_size or shape[0], config.seq_len or shape[1])
    if shape != expected or any(v.shape[1:] != shape for v in stacked.values()):
        raise ValueError(f"batch arrays have shapes { {k: v.shape[1:] for k, v in stacked.items()} }; the config "
                         f"expects (batch_size, seq_len) = {expected} for every key.")
    for key in ("input_ids", "positions", "segment_ids"):
        if key in stacked:
            stacked[key] = stacked[key].astype(np.int32)
    return stacked


def _host(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(values).items()}


def _json_value(value: Any) -> Any:
    """config.json: mappings (LossWeights) as objects, anything else JSON cannot write as its repr."""
    return dict(value) if isinstance(value, Mapping) else repr(value)


def _by_step(records: list[dict[str, Any]], last_step: int) -> list[dict[str, Any]]:
    """One record per step up to `last_step` (the latest written wins: a step redone after a rollback)."""
    return sorted({r["step"]: r for r in records if r["step"] <= last_step}.values(), key=lambda r: r["step"])


class TrainingLoop:
    """Drives a run: which stage and step come next, their schedule values, logging, the divergence guard,
    checkpoints, resume and evaluations. The student's training state lives in `runner` (a StepRunner); the loop
    owns the run's bookkeeping (step, history, learning-rate scale, rollbacks, data position)."""

    def __init__(self, runner, data, config: DistillConfig, mesh, eval_data, teacher, student):
        self.runner, self.data, self.config, self.mesh = runner, data, config, mesh
        self.step, self.lr_scale, self.rollbacks = 0, 1.0, 0
        self.good_losses: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.resumed_history: list[dict[str, Any]] = []  # records of steps done before this call (from `meta`)
        self.resumed_evals: list[dict[str, Any]] = []
        self.stop = StopSignals()
        self.skipped_checkpoints: list[str] = []
        ckpt = config.checkpoint
        self.stale_saves = remove_unfinished_saves(ckpt.directory) if ckpt.directory else []
        self.checkpointer = Checkpointer(ckpt.directory, ckpt.keep) if ckpt.directory else None
        if self.checkpointer is None and config.guard.enabled and jax.process_count() > 1:
            raise ValueError("a multi-host run keeps its rollback state in checkpoints: set checkpoint.directory "
                             "(shared storage), or disable the divergence guard (guard.enabled=False).")
        self.snapshot: dict[str, Any] | None = None
        self.eval_batches = [put_batch({k: np.asarray(v) for k, v in b.items()}, mesh)
                             for b in data.eval_batches(eval_data, config.eval_batches)]
        self.teacher, self.student = teacher, student
        self.peak = device_peak_flops(config.peak_flops)
        self.devices = mesh.size if mesh is not None else 1
        self.flops: float | None = None
        self.logger: MetricsLogger | None = None
        self._last_eval_step = -1
        self.data_state = data.state()  # position after the last completed step

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
        self.logger = MetricsLogger(config.run_dir, config.total_steps, start_step=self.step,
                                    progress=config.progress)
        if config.run_dir and jax.process_index() == 0:
            with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as handle:
                json.dump(dataclasses.asdict(config), handle, indent=1, default=_json_value)

    def _run(self) -> None:
        config = self.config
        resumed = self._resume()
        if not resumed:
            self._enter(config.stage_at(0)[0], carry=False)
        self._open_logs()
        if self.stale_saves:
            self._event("cleanup", f"removed {len(self.stale_saves)} unfinished checkpoint write(s) of an earlier "
                                   f"run: {', '.join(self.stale_saves)}")
        for note in self.skipped_checkpoints:
            self._event("checkpoint_unreadable", note)
        if resumed:
            self._event("resume", f"resumed from step {self.step} (stage {self.runner.stage_index}) in "
                                  f"{self.checkpointer.directory}")
            if self._eval_due():  # the run stopped between this checkpoint and its evaluation
                self._evaluate()
        else:
            self._event("stage", self._stage_line(self.runner.stage_index, 0), stage=self.runner.stage_index,
                        carried=0)
            self._mark_good()
            self._evaluate()
        last_step = min(config.total_steps, config.halt_after or config.total_steps)
        prefetched = None
        while self.step < config.total_steps:
            self._stop_if_asked()
            index, in_stage = config.stage_at(self.step)
            if index != self.runner.stage_index:
                carried = self._enter(index, carry=True)
                self.good_losses = []  # the loss scale changes with the weights
                self._event("stage", self._stage_line(index, carried), stage=index, carried=carried)
            batch, self.data_state = prefetched or self._next_batch()
            stage = config.stages[index]
            hyper = hyper_values(stage, in_stage, config.optimizer.weight_decay, self.lr_scale)
            started = time.perf_counter()
            pending, first_of_stage = self.runner.train_step(batch, hyper)  # dispatched asynchronously
            prefetched = self._next_batch() if self.step + 1 < last_step else None  # host work overlaps the step
            values = _host(pending)
            elapsed = time.perf_counter() - started
            reason = self._divergence(values)
            if reason:
                self._rollback(reason, values)
                continue
            self.step += 1
            self.good_losses = (self.good_losses + [values["loss"]])[-config.guard.window:]
            self._log_step(values, hyper, elapsed, index, batch, first_of_stage)
            if self.step % config.checkpoint.every == 0 or self.step == config.total_steps:
                self._mark_good()
            if self._eval_due():
                self._evaluate()
            if config.halt_after is not None and self.step >= config.halt_after:
                self._mark_good()
                self._event("halt", f"halted after step {self.step} (halt_after={config.halt_after})")
                return
        if self._last_eval_step != self.step:
            self._evaluate()

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
            if self.config.run_dir and self.config.plots and jax.process_index() == 0:
                plot_history(self.logger.records, os.path.join(self.config.run_dir, "curves.png"))
        if self.checkpointer is not None:
            self.checkpointer.close()

    # ------------------------------------------------------------------------------------------ pieces
    def _enter(self, index: int, *, carry: bool) -> int:
        return self.runner.enter_stage(index, carry=carry)

    def _stage_line(self, index: int, carried: int) -> str:
        stage, runner = self.config.stages[index], self.runner
        counts = freeze.describe_split(runner.params["student"], runner.frozen)
        active = {k: v for k, v in stage.weights.as_dict().items() if v}
        return (f"stage {index}{' (' + stage.name + ')' if stage.name else ''}: {stage.steps} steps, "
                f"{counts['trainable']:,} trainable / {counts['frozen']:,} frozen parameters, lr "
                f"{stage.learning_rate:g}, weights {active}, temperature {stage.temperature.start:g}->"
                f"{stage.temperature.end:g}; carried {carried} optimizer-state leaves")

    def _event(self, kind: str, message: str, **fields: Any) -> None:
        record = {"event": kind, "step": self.step, "message": message, **fields}
        self.events.append(record)
        self.logger.message(message, event=kind, step=self.step, **fields)

    def _next_batch(self) -> tuple[dict[str, Any], Any]:
        """The next step's micro-batches on the mesh, and the data position just after them (what a checkpoint
        taken after that step records, even when a further batch has been prefetched)."""
        batches = [self.data.next() for _ in range(self.config.grad_accum)]
        return put_batch(_stack(batches, self.config), self.mesh, leading=1), self.data.state()

    def _log_step(self, values, hyper, elapsed: float, index: int, batch, first_of_stage: bool) -> None:
        accum, batch_size, seq_len = batch["input_ids"].shape
        tokens = accum * batch_size * seq_len
        if self.flops is None:
            self.flops = step_flops(self.student, self.teacher, tokens, seq_len)
        record = {"step": self.step, "stage": index, **values, "perplexity": math.exp(min(values["student_ce"], 80)),
                  "lr": float(hyper["lr"]), "temperature": float(hyper["temperature"]), "step_time_s": elapsed,
                  "tokens_per_s": tokens / elapsed, "tflops_per_s": self.flops / elapsed / 1e12}
        if first_of_stage:
            record["warmup"] = True  # first step after entering a stage: may include compilation
        if self.peak:
            record["mfu"] = self.flops / (elapsed * self.devices * self.peak)
        self.history.append(record)
        self.logger.step(record)

    def _eval_due(self) -> bool:
        """An evaluation at this step not done yet: at step 0 (before training) and every `eval_every` steps."""
        every = self.config.eval_every
        return (self.step == 0 or bool(every) and self.step % every == 0) and self._last_eval_step != self.step

    def _evaluate(self) -> None:
        if not self.eval_batches:
            return
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
        self.evals.append(record)
        self.logger.evaluation(record)
        self._last_eval_step = self.step

    # ------------------------------------------------------------------------------------------ guard
    def _divergence(self, values: dict[str, float]) -> str | None:
        guard, loss = self.config.guard, values["loss"]
        finite = math.isfinite(loss) and values.get("finite", 1.0) == 1.0
        if not guard.enabled:
            if not finite:
                raise DivergenceError(f"step {self.step + 1}: non-finite loss {loss} (the guard is disabled; "
                                      "parameters were left at their last finite values).")
            return None
        if not finite:
            return f"non-finite loss or gradient (loss {loss}, grad norm {values.get('grad_norm')})"
        if len(self.good_losses) >= guard.min_history:
            median = statistics.median(self.good_losses)
            if median > 0 and loss > guard.spike_factor * median:
                return f"loss {loss:.4g} exceeds {guard.spike_factor:g} x the running median {median:.4g}"
        return None

    def _rollback(self, reason: str, values: dict[str, float]) -> None:
        guard = self.config.guard
        self.rollbacks += 1
        if self.rollbacks > guard.max_rollbacks:
            raise DivergenceError(f"step {self.step + 1}: {reason}; giving up after {guard.max_rollbacks} rollbacks "
                                  f"(learning rate already scaled by {self.lr_scale:g}). Lower the learning rate, "
                                  "raise warmup, or check the data for corrupt batches.")
        failed_step = self.step + 1
        restored = self._restore_last_good()
        self.lr_scale *= guard.lr_backoff
        if self.logger is not None:
            self.logger.rewind(self.step)
        self._event("rollback", f"DIVERGENCE at step {failed_step}: {reason}. Rolled back to step {restored} and "
                                f"scaled the learning rate by {guard.lr_backoff:g} (now x{self.lr_scale:g}); "
                                f"rollback {self.rollbacks} of {guard.max_rollbacks}.",
                    failed_step=failed_step, restored_step=restored, lr_scale=self.lr_scale)

    # ------------------------------------------------------------------------------------------ interruption
    def _stop_if_asked(self) -> None:
        """After a first SIGINT/SIGTERM: checkpoint the last completed step (when a directory is set) and raise
        RunInterrupted. A second signal during that write abandons it (orbax never finalises it)."""
        if self.stop.received is None:
            return
        if self.checkpointer is not None:
            self._mark_good()
        raise self._interrupted(self.stop.received, saved=self.checkpointer is not None)

    def _interrupted(self, cause: str, *, saved: bool) -> RunInterrupted:
        where = self.checkpointer.directory if self.checkpointer is not None else None
        latest = None if where is None else self.step if saved else self._latest_complete_step()
        message = interruption_message(cause, self.step, self.config.total_steps, saved=saved, directory=where,
                                       checkpoint_step=latest)
        if self.logger is not None:
            self._event("interrupt", message, checkpoint_step=latest)
        return RunInterrupted(message, step=self.step, checkpoint_step=latest, directory=where)

    def _latest_complete_step(self) -> int | None:
        """The newest finalised checkpoint on disk (not the manager's cached list: a write may have been cut)."""
        try:
            self.checkpointer.manager.reload()
            return self.checkpointer.latest_step()
        except Exception:  # noqa: BLE001 - only for the message; the checkpoint itself is not touched
            return None

    # ------------------------------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "stage": self.runner.stage_index, "data_state": self.data_state,
                "lr_scale": self.lr_scale, "rollbacks": self.rollbacks, "good_losses": self.good_losses,
                "seed": self.config.seed, "total_steps": self.config.total_steps,
                "history": _by_step(self.resumed_history + self.history, self.step),
                "evals": _by_step(self.resumed_evals + self.evals, self.step)}

    def _mark_good(self) -> None:
        """Record the current state as the rollback target (checkpoint, else host copy)."""
        runner = self.runner
        if self.checkpointer is not None:
            if self.checkpointer.latest_step() != self.step:
                self.checkpointer.save(self.step, student=runner.full_state(), optimizer=runner.opt,
                                       projections=runner.params["proj"], meta=self._meta())
        elif self.config.guard.enabled:
            self.snapshot = {"step": self.step, "stage": runner.stage_index,
                             "student": jax.device_get(runner.full_state()), "opt": jax.device_get(runner.opt),
                             "proj": jax.device_get(runner.params["proj"])}

    def _restore_last_good(self) -> int:
        runner = self.runner
        if self.checkpointer is not None and self.checkpointer.latest_step() is not None:
            meta = self._restore_checkpoint(self.checkpointer.latest_step())
            return int(meta["step"])
        if self.snapshot is None:
            raise DivergenceError("diverged before any good state was recorded.")
        snap = self.snapshot
        runner.load(snap["stage"], snap["student"], snap["opt"], snap["proj"])
        self.step = snap["step"]
        return self.step

    def _restore_checkpoint(self, step: int) -> dict[str, Any]:
        runner, checkpointer = self.runner, self.checkpointer
        meta = checkpointer.read_meta(step)
        runner.enter_stage(int(meta["stage"]), carry=False)  # templates of the right structure and placement
        student_state, opt_state, projections = checkpointer.restore(
            step, student=runner.full_state(), optimizer=runner.opt, projections=runner.params["proj"])
        runner.load(int(meta["stage"]), student_state, opt_state, projections)
        self.step = int(meta["step"])
        return meta

    def _resume(self) -> bool:
        checkpointer = self.checkpointer
        if checkpointer is None or not self.config.checkpoint.resume or checkpointer.latest_step() is None:
            return False
        meta = self._restore_newest_readable()
        self.data.restore(meta["data_state"])
        self.data_state = meta["data_state"]
        self.lr_scale, self.rollbacks = float(meta["lr_scale"]), int(meta["rollbacks"])
        self.good_losses = [float(x) for x in meta["good_losses"]]
        self.resumed_history, self.resumed_evals = list(meta.get("history", [])), list(meta.get("evals", []))
        self._last_eval_step = max((r["step"] for r in self.resumed_evals), default=-1)
        return True

    def _restore_newest_readable(self) -> dict[str, Any]:
        """Restore the newest checkpoint that reads back; an unreadable one (damaged after it was written) is
        reported and the next older one is tried."""
        steps = sorted(self.checkpointer.manager.all_steps(), reverse=True)
        for position, step in enumerate(steps):
            try:
                return self._restore_checkpoint(step)
            except Exception as error:  # noqa: BLE001 - any read failure: fall back, or re-raise on the last
                if position == len(steps) - 1:
                    raise
                self.skipped_checkpoints.append(f"step {step} in {self.checkpointer.directory} could not be read "
                                                f"({type(error).__name__}: {error}); trying step {steps[position + 1]}")
        raise AssertionError("unreachable: latest_step() named a checkpoint")


__all__ = ["TrainingLoop", "DivergenceError"]
