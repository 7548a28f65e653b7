"""Out-of-memory handling: when compiling or running the train step fails with RESOURCE_EXHAUSTED, retry with
less memory, following `OOMConfig.sequence` (default "layers_dots", "layers", "halve_batch"):

* a remat value (`DistillConfig.remat`): rematerialise the student forward that way from now on;
* "halve_batch": half the micro-batch and twice the gradient accumulation. The data still gives batches of the
  configured size; each is split into two micro-batches inside the same optimizer step, so the update (its
  global batch, its normalisation by the step's token count) is unchanged.

The remat values are ranked by the memory they save (`REMAT_RANK`), and a retry only ever moves up. "dots" and
"full" checkpoint the whole student forward: its backward pass recomputes the whole forward and then holds every
layer's activations at once, so they lower the peak little or not at all (compiled for a TPU, "full" needs the
temporaries of no remat). "layers_dots" and "layers" checkpoint each layer: the backward holds one layer's
activations at a time, plus the residual stream ("layers_dots" also every layer's matmul outputs, for less
recomputation). "layers" costs what "full" costs (one more student forward) and saves more, so the default ladder
tries the per-layer policies, cheaper recomputation first, and leaves the whole-forward ones out; they stay
accepted in a configured sequence.

A choice that would change nothing (a remat saving no more than the one in force, a micro-batch of one row or one
that would no longer split over the mesh's data axes) is skipped. Each decision is an event and is written to
`run_dir/oom_decisions.json`; `run_dir/config.json` is rewritten with the settings in force (remat, batch_size,
grad_accum), so the run can be repeated without the failed attempts. Checkpoints keep the decisions, so a resumed
run starts with them. When the sequence is exhausted the run stops with OutOfMemoryError, saying what was tried.

`compile_hooks` are called before each compilation of the train step with a `CompileRequest`; a hook may raise
(tests inject RESOURCE_EXHAUSTED this way: CPU memory is too plentiful to run out of honestly).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np

from ..distributed import local_rows
from ..mesh import data_split, put_batch

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
REMAT_RANK = {None: 0, "dots": 1, "full": 2, "layers_dots": 3, "layers": 4}  # by the memory each saves


class OutOfMemoryError(RuntimeError):
    """The train step ran out of device memory and every configured retry was tried."""


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What the train step is about to be compiled with: stage, remat, micro-batch rows, micro-batches per step."""

    stage: int
    remat: str | None
    micro_batch: int
    grad_accum: int


compile_hooks: list[Callable[[CompileRequest], None]] = []


def run_compile_hooks(request: CompileRequest) -> None:
    for hook in list(compile_hooks):
        hook(request)


def is_out_of_memory(error: BaseException) -> bool:
    """An XLA runtime error (jax's JaxRuntimeError / XlaRuntimeError) saying RESOURCE_EXHAUSTED or out of memory."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"JaxRuntimeError", "XlaRuntimeError"}) and any(m in str(error) for m in OOM_MARKERS)


@dataclasses.dataclass
class MemoryPlan:
    """The memory settings in force: remat, and how many micro-batches each data batch is split into."""

    remat: str | None
    split: int = 1
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tried: int = 0  # entries of the sequence used up

    def next_action(self, sequence: tuple[str, ...], micro_batch: int, data_split: int) -> str | None:
        """The next useful entry of `sequence` (and mark it used); None when exhausted. `data_split`: how many
        ways the mesh splits a micro-batch (its rows must stay a multiple of it)."""
        while self.tried < len(sequence):
            action = sequence[self.tried]
            self.tried += 1
            if action in REMAT_RANK and REMAT_RANK[action] > REMAT_RANK[self.remat]:
                return action
            if action == "halve_batch" and micro_batch % 2 == 0 and (micro_batch // 2) % max(data_split, 1) == 0:
                return action
        return None

    def apply(self, action: str, step: int, reason: str, micro_batch: int, grad_accum: int) -> dict[str, Any]:
        """Take `action`; returns its decision record (also kept in `decisions`)."""
        before = {"remat": self.remat, "micro_batch": micro_batch, "grad_accum": grad_accum}
        if action in REMAT_RANK:
            self.remat = action
        else:
            self.split *= 2
        after = {"remat": self.remat, "micro_batch": micro_batch // (2 if action == "halve_batch" else 1),
                 "grad_accum": grad_accum * (2 if action == "halve_batch" else 1)}
        decision = {"step": step, "action": action, "reason": reason, "before": before, "after": after}
        self.decisions.append(decision)
        return decision

    def state(self) -> dict[str, Any]:
        return {"remat": self.remat, "split": self.split, "decisions": self.decisions, "tried": self.tried}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state:
            self.remat, self.split = state["remat"], int(state["split"])
            self.decisions, self.tried = list(state["decisions"]), int(state["tried"])


def split_micro_batches(stacked: dict[str, np.ndarray], factor: int) -> dict[str, np.ndarray]:
    """(A, B, T) host arrays -> (A * factor, B / factor, T): each micro-batch becomes `factor` consecutive ones."""
    if factor == 1:
        return stacked
    out = {}
    for key, value in stacked.items():
        accum, rows = value.shape[:2]
        out[key] = value.reshape(accum * factor, rows // factor, *value.shape[2:])
    return out


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def exhausted_message(plan: MemoryPlan, error: BaseException, micro_batch: int) -> str:
    tried = ", ".join(d["action"] for d in plan.decisions) or "nothing (no retry applies)"
    return (f"the train step ran out of device memory ({first_line(error)}) with remat={plan.remat!r} and "
            f"micro-batches of {micro_batch} rows, after trying {tried}. Lower batch_size or seq_len, use a mesh "
            "over more devices (DistillConfig.mesh), a smaller logit_chunk, compute_dtype='bfloat16', or freeze "
            "more of the student.")


def _json_value(value: Any) -> Any:
    """config.json: mappings (LossWeights) as objects, anything else JSON cannot write as its repr."""
    return dict(value) if isinstance(value, Mapping) else repr(value)


class MemoryRetries:
    """Dispatching the train step with retries on out-of-memory, collaborator of the training loop.

    State: `plan` (the MemoryPlan in force: remat, micro-batch split, decisions), `data_rows` (this process's rows
    of a data batch, for config.json). The loop hands it the runner, `report(kind, message, **fields)` for its
    events and `restore()` to put back the last good state when a failed step consumed the training state."""

    def __init__(self, config: Any, runner: Any, mesh: Any, data_rows: int | None,
                 report: Callable[..., None], restore: Callable[[], int]):
        self.config, self.runner, self.mesh = config, runner, mesh
        self.retry, self.sequence = config.oom.retry, config.oom.sequence  # validated by OOMConfig
        self.plan = MemoryPlan(runner.remat)
        self.data_rows = data_rows
        self.report, self.restore_last_good = report, restore

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return self.plan.decisions

    def write_config(self) -> None:
        """run_dir/config.json: the configuration in force (after OOM decisions), and oom_decisions.json."""
        config, plan = self.config, self.plan
        if not config.run_dir or jax.process_index() != 0:
            return
        os.makedirs(config.run_dir, exist_ok=True)
        if plan.decisions:
            rows = self.data_rows // plan.split if self.data_rows else None
            config = dataclasses.replace(config, remat=plan.remat, grad_accum=config.grad_accum * plan.split,
                                         batch_size=rows)
            with open(os.path.join(config.run_dir, "oom_decisions.json"), "w", encoding="utf-8") as handle:
                json.dump(plan.decisions, handle, indent=1)
        try:  # what DistillConfig.from_dict reads back (the run can be repeated from its folder)
            data = config.to_dict()
        except (ValueError, TypeError):  # e.g. an NNX filter in a stage: written as its repr
            data = dataclasses.asdict(config)
        with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, default=_json_value)

    def dispatch(self, batch, hyper, step: int):
        """Dispatch the step after global step `step`, retrying with less memory on RESOURCE_EXHAUSTED: (batch
        as run, metrics on the device, whether the step may include compilation), or None when a failed run
        consumed the state (then restored to the last good one)."""
        retried = False
        while True:
            try:
                pending, first = self.runner.train_step(batch, hyper)
                return batch, pending, first or retried
            except Exception as error:  # noqa: BLE001 - only out-of-memory errors are handled
                if not (self.retry and is_out_of_memory(error)):
                    raise
                batch, retried = self._after_oom(error, batch, step), True
                if batch is None:
                    return None

    def _after_oom(self, error: BaseException, batch, step: int):
        """The next memory decision, applied; the batch re-split for it (None when the state had to be restored)."""
        accum, rows = batch["input_ids"].shape[:2]
        split = data_split(self.mesh)[1] if self.mesh else 1
        action = self.plan.next_action(self.sequence, int(rows), split)
        if action is None:
            raise OutOfMemoryError(exhausted_message(self.plan, error, int(rows))) from error
        decision = self.plan.apply(action, step + 1, first_line(error), int(rows), int(accum))
        if action in REMAT_RANK:
            self.runner.set_remat(self.plan.remat)
        lost = self.runner.state_lost()
        restored = self.restore_last_good() if lost else None
        after, at = decision["after"], (step if restored is None else restored) + 1
        self.report("oom", f"OUT OF MEMORY at step {at} ({decision['reason']}): retrying with remat="
                           f"{after['remat']!r}, micro-batches of {after['micro_batch']} rows x {after['grad_accum']}"
                           + (f"; the failed step consumed the training state, restored step {restored}" if lost
                              else ""), failed_step=decision["step"],
                    **{key: value for key, value in decision.items() if key != "step"})
        self.write_config()
        if lost:
            return None
        host = {key: local_rows(value, axis=1) for key, value in batch.items()}  # this process's rows
        return put_batch(split_micro_batches(host, 2), self.mesh, leading=1) if action == "halve_batch" else batch

    def state(self) -> dict[str, Any]:
        return self.plan.state()

    def restore(self, state: dict[str, Any] | None) -> None:
        """A resumed run starts with the memory decisions of the run it continues."""
        if state and state.get("decisions"):
            self.plan.restore(state)
            self.runner.set_remat(self.plan.remat)


__all__ = ["MemoryRetries", "OutOfMemoryError", "CompileRequest", "compile_hooks", "run_compile_hooks",
           "is_out_of_memory", "MemoryPlan", "split_micro_batches", "exhausted_message", "REMAT_RANK"]
