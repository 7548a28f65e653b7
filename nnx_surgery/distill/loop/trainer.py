"""`distill.run(teacher, student, data, config)`: check the models, place them, and run the training loop.

The pieces, in order of ownership: `run` (here) checks the models against each other and the config, places
them on the mesh and resolves the layer correspondence; `TrainingLoop` (driver.py) drives the steps: stages,
schedules, logging and evaluation, calling its collaborators (divergence guard, fallbacks, checkpoints and
resume, OOM retries, targets); `StepRunner` (step_runner.py) holds
the student's training state for the current stage and runs the compiled steps (train_step.py). Stages switch by
re-splitting the student with the new trainable set; Adam moments of parameters that stay trainable (and the step
counter) carry over (freeze.carry_matching).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Generic, TypeVar

import jax
from flax import nnx

from ..losses import term_registry as terms
from .run_config import DistillConfig
from ..interface import Correspondence, Sampler, check_model, correspondence_from_plan
from ..interruption import RunInterrupted
from ..losses.representations import init_projections
from ..mesh import check_mesh_fits, make_mesh, model_on_mesh, replicated, shard_model
from .oom import OutOfMemoryError
from .schedules import resolve_epochs
from ..trimmed_vocab import in_student_vocabulary
from .driver import DivergenceError, TrainingLoop
from .step_runner import StepRunner, release_free_heap
from nnx_surgery.distill.loop.cache_replay import prepare_cached_run

log = logging.getLogger("distill")
StudentT = TypeVar("StudentT", bound=nnx.Module)  # the student's class: `run` gives the same module back


@dataclasses.dataclass
class DistillResult(Generic[StudentT]):
    student: StudentT  # the same module that was passed in, trained in place
    history: list[dict[str, Any]]  # one record per optimizer step
    evals: list[dict[str, Any]]  # held-out evaluations
    events: list[dict[str, Any]]  # stage switches, rollbacks, resumes
    projections: dict[str, jax.Array]  # learned feature projections (empty unless feature_projection)
    steps: int
    run_dir: str | None = None
    # After a resume: the records of the steps and evaluations done before this call (from the checkpoint).
    resumed_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed_evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    data_state: Any = None  # the data position after the last step (pass it to `data.restore` to continue)
    resumed_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The last evaluation's targets: {name: {"metric", "value", "threshold", "met"}} (met None: not measured)
    targets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    stopped_early: bool = False  # targets.stop_when_met ended the run
    # Fractions of the loop's wall time (this call, compiling steps left out): utilisation (in the step),
    # data_fraction, host_fraction, and mfu where the peak is known; empty before a measured step
    utilisation: dict[str, float] = dataclasses.field(default_factory=dict)
    oom_decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # memory retries (oom.py)

    @property
    def targets_met(self) -> list[str]:
        """The set targets the last evaluation met."""
        return [name for name, entry in self.targets.items() if entry["met"]]

    @property
    def full_history(self) -> list[dict[str, Any]]:
        """One record per step of the whole run, across resumes (`history` holds this call's steps only)."""
        return self.resumed_history + self.history

    @property
    def full_evals(self) -> list[dict[str, Any]]:
        return self.resumed_evals + self.evals

    @property
    def full_events(self) -> list[dict[str, Any]]:
        return self.resumed_events + self.events


class DataStream:
    """Uniform view of the data: an object with `next_batch()` (and optionally `state()` / `restore(state)`), or
    any iterable of batch dicts (its position is the number of batches taken; restoring re-iterates and skips)."""

    def __init__(self, data: Any):
        self.source = data
        self.taken = 0
        self._iterator = None if hasattr(data, "next_batch") else iter(data)

    def next(self) -> dict[str, Any]:
        self.taken += 1
        if self._iterator is None:
            return self.source.next_batch()
        try:
            return next(self._iterator)
        except StopIteration:
            raise RuntimeError(f"the data ran out after {self.taken - 1} batches; give more batches or fewer "
                               "steps.") from None

    def state(self) -> Any:
        if hasattr(self.source, "state"):
            return self.source.state()
        return {"batches_taken": self.taken}

    def eval_batches(self, eval_data: Any, count: int) -> list[dict[str, Any]]:
        """Up to `count` held-out batches: from `eval_data`, else the source's `eval_batches()` when it has one."""
        if eval_data is None and hasattr(self.source, "eval_batches"):
            eval_data = self.source.eval_batches
            if callable(eval_data):
                takes_count = bool(inspect.signature(eval_data).parameters)
                eval_data = eval_data(count) if takes_count else eval_data()
        if eval_data is None:
            return []
        batches = []
        for batch in eval_data:
            if len(batches) >= count:
                break
            batches.append(batch)
        return batches

    def restore(self, state: Any) -> None:
        if hasattr(self.source, "restore"):
            self.source.restore(state)
            return
        if self._iterator is None or iter(self.source) is self.source:
            raise RuntimeError("cannot restore the data position: the data is a one-shot iterator without "
                               "restore(); pass a re-iterable (list, dataset) or an object with state()/restore().")
        self._iterator, self.taken = iter(self.source), 0
        for _ in range(int(state["batches_taken"])):
            self.next()


def _depth(model: Any) -> int | None:
    cfg: Any = getattr(model, "config", None)
    if hasattr(cfg, "num_hidden_layers"):
        return int(cfg.num_hidden_layers)
    layers = getattr(model, "layers", None)
    return len(layers) if layers is not None else None


def resolve_correspondence(config: DistillConfig, teacher: Any, student: Any) -> Correspondence:
    """From the config, else the plan, else identity (same depth) or a uniform map ending at the last layers."""
    if config.correspondence is not None:
        corr = config.correspondence
    elif config.plan is not None:
        corr = correspondence_from_plan(config.plan)
    else:
        t_depth, s_depth = _depth(teacher), _depth(student)
        if t_depth is None or s_depth is None:
            raise ValueError("the loss terms on layer outputs need a layer map: set DistillConfig.correspondence or "
                             "plan.")
        corr = Correspondence(tuple((round((j + 1) * t_depth / s_depth) - 1, j) for j in range(s_depth)))
    t_depth, s_depth = _depth(teacher), _depth(student)
    if t_depth is not None and s_depth is not None:
        corr.validate(t_depth, s_depth)
    return corr


def _check_models(teacher: Any, student: Any, config: DistillConfig) -> None:
    """Both follow the DistillModel interface, share a vocabulary, and a teacher-less run weights no teacher loss."""
    check_model(student, "student")
    if teacher is None and config.teacher_cache is not None:
        return  # a teacher cache: checked by cache_replay.prepare_cached_run
    if teacher is None:
        needy = {s.name or str(i): terms.needing_teacher(s.weights) for i, s in enumerate(config.stages)}
        needy = {stage: names for stage, names in needy.items() if names}
        if needy:
            raise ValueError(f"teacher=None trains on hard labels only, but stage(s) {sorted(needy)} weight teacher "
                             f"losses ({needy}); set those weights to 0 or pass a teacher.")
        return
    check_model(teacher, "teacher")
    v_t, v_s = teacher.head_matrix().shape[0], student.head_matrix().shape[0]
    if v_t != v_s:
        raise ValueError(f"the teacher's vocabulary has {v_t} entries and the student's {v_s}; logit "
                         "distillation needs the same tokenizer and vocabulary on both sides, or, for a student "
                         "with a trimmed vocabulary, DistillConfig(plan=its plan) or vocab_map=plan.kept_vocab.")


def _from_cache(teacher: Any, student: Any, data: Any, config: DistillConfig) -> tuple[Any, DistillConfig]:
    """(the cache's data stream, the config with the cache's top k) of a run from `config.teacher_cache`."""

    if teacher is not None:
        raise ValueError(f"teacher_cache={config.teacher_cache!r} trains from the cached teacher: pass teacher=None "
                         "(or drop teacher_cache to distil from the teacher model).")
    config, stream = prepare_cached_run(config, student, data)
    return stream, config


def _check_on_policy(config: DistillConfig, teacher: Any, sampler: Any) -> None:
    """On-policy steps need a sampler and a teacher to score the samples, on one process (the prompts are each
    process's own rows; sampling a globally sharded model from them is not supported yet)."""
    if not config.on_policy.fraction:
        return
    if not callable(sampler):
        raise ValueError(f"on_policy.fraction={config.on_policy.fraction:g} needs a sampler of the student: pass "
                         "distill.run(..., sampler=surgery.make_sampler()) (see distill.interface.Sampler), "
                         "or set on_policy.fraction=0.")
    if teacher is None:
        raise ValueError("on-policy steps are scored by the teacher: pass a teacher, or set on_policy.fraction=0.")
    if jax.process_count() > 1:
        raise ValueError("on-policy distillation runs on one process for now; set on_policy.fraction=0 on "
                         "multi-host runs.")


def _place(teacher: Any, student: Any, config: DistillConfig):
    """The run's mesh (None: one device), after checking it fits, with both models placed on it."""
    mesh = make_mesh(config.mesh, devices=config.mesh_devices) if config.mesh is not None else None
    check_mesh_fits(mesh, {"teacher": teacher, "student": student},
                    None if config.batch_size is None else config.batch_size)
    if mesh is not None:
        for model in (teacher, student):
            if model is not None and not model_on_mesh(model, mesh):
                shard_model(model, mesh)
    return mesh


def _projections(config: DistillConfig, corr: Correspondence, teacher: Any, student: Any, mesh) -> dict:
    """Learned (D_s, D_t) projections, when `feature_projection` is set and a stage uses a term that takes them."""
    if not config.feature_projection or not terms.run_needs(config, "uses_projections"):
        return {}
    d_t, d_s = teacher.head_matrix().shape[1], student.head_matrix().shape[1]
    projections = init_projections(corr, d_s, d_t, config.seed)
    return jax.device_put(projections, replicated(mesh)) if mesh is not None else projections


def prepare_run(teacher: Any, student: Any, data: Any, config: DistillConfig,
                sampler: Sampler | None = None) -> tuple[Any, Any, DistillConfig, Any, StepRunner]:
    """What `run` does before its loop: (the teacher as the step sees it, the data stream, the config with its
    epochs in steps, the mesh, the StepRunner), with the models checked and placed. `lowering.compile_ahead` builds
    its programs from the same runner, so that they are the ones the run then calls."""
    if config.teacher_cache is not None:  # the teacher's top k read from a cache: no teacher model
        data, config = _from_cache(teacher, student, data, config)
    config = resolve_epochs(config, data)  # stages given in epochs of `data` -> steps
    teacher = in_student_vocabulary(teacher, student, config)  # a trimmed student: the teacher in its token ids
    _check_models(teacher, student, config)
    _check_on_policy(config, teacher, sampler)
    mesh = _place(teacher, student, config)
    needs_map = terms.run_needs(config, "uses_layer_map")
    corr = resolve_correspondence(config, teacher, student) if needs_map else Correspondence()
    projections = _projections(config, corr, teacher, student, mesh)
    return teacher, data, config, mesh, StepRunner(teacher, student, config, mesh, corr, projections)


def run(teacher: nnx.Module | None, student: StudentT, data: Any, config: DistillConfig, *,
        eval_data: Any = None, sampler: Sampler | None = None) -> DistillResult[StudentT]:
    """Distil `teacher` into `student` (trained in place) following `config`.

    `teacher`, `student`: NNX modules with the DistillModel interface (interface.py); the teacher is never trained
    and may be in a lower precision. `teacher=None` trains the student on hard labels alone (every stage may only
    weight `ce`), e.g. to make a small teacher for demos. With `config.mesh` both are placed on the mesh
    (`mesh.shard_model`) unless they already live there. `data`: an object with `next_batch()` (optionally
    `state()`/`restore()` and `eval_batches()`), or an iterable of dicts with `input_ids` (B, T) int32, optional
    `loss_mask` (B, T) (`loss_mask[b, t]` weights the prediction made at position t of token t + 1) and
    `attention_mask`. `eval_data`: held-out batches (default: `data.eval_batches()` when it exists). `sampler`:
    the student's sampler for on-policy steps (`config.on_policy`; the `Sampler` of interface.py, e.g.
    `surgery.make_sampler()`), needed only when `config.on_policy.fraction` > 0. Returns a
    DistillResult with per-step metrics, evaluations (with the targets they meet), events (stage switches,
    rollbacks, fallbacks, OOM decisions, resume), the last targets' report and the loop's utilisation.

    With `config.checkpoint.directory` set, a run resumes from the newest complete checkpoint there. A first
    SIGINT (Ctrl-C) or SIGTERM finishes the current step, checkpoints it and raises RunInterrupted (a
    KeyboardInterrupt) saying which step was saved and how to resume; a second one stops at once."""
    teacher, data, config, mesh, runner = prepare_run(teacher, student, data, config, sampler)
    projections = runner.projections
    release_free_heap()
    loop = TrainingLoop(runner, DataStream(data), config, mesh, eval_data, teacher, student, sampler)
    try:
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            loop.run()
    finally:
        runner.give_back()
        loop.close()
    return DistillResult(student=student, history=loop.history, evals=loop.evals, events=loop.events,
                         projections=runner.params["proj"] if runner.params else projections,
                         steps=loop.step, run_dir=config.run_dir, resumed_history=loop.resumed_history,
                         resumed_evals=loop.resumed_evals, data_state=loop.data_state,
                         resumed_events=loop.resumed_events, targets=loop.monitor.report,
                         stopped_early=loop.stopped_early, utilisation=loop.monitor.times.fractions() or {},
                         oom_decisions=list(loop.memory.decisions))


__all__ = ["run", "DistillResult", "DivergenceError", "OutOfMemoryError", "RunInterrupted", "DataStream",
           "resolve_correspondence"]
