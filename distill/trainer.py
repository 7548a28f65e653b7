"""`distill.run(teacher, student, data, config)`: the training loop around the jitted step.

Per step: take `grad_accum` micro-batches from `data`, place them on the mesh, compute host-side schedule values
(learning rate, temperature, loss weights) for the current stage, run the step, log metrics, apply the divergence
guard, checkpoint, evaluate. Stages switch by re-splitting the student with the new trainable set; Adam moments of
parameters that stay trainable (and the step counter) carry over (freeze.carry_matching).

Buffer ownership: the step donates the trainable parameters; on entering a stage, those not made by the step are
replaced by XLA-made copies (in the student module too: see `_donatable`), which the first step consumes; the
module is written back (nnx.update) at stage switches, checkpoints and the end of the run, also when the run
stops with an error.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from . import freeze
from .config import DistillConfig
from .interface import Correspondence, check_model, correspondence_from_plan
from .interruption import RunInterrupted
from .logit_loss import LogitLossSpec
from .losses import init_projections
from .mesh import check_mesh_fits, make_mesh, model_on_mesh, shard_model
from .step import AdamSettings, StepSpec, build_eval_step, build_train_step

log = logging.getLogger("distill")


class DivergenceError(RuntimeError):
    """The loss kept diverging after the configured number of rollbacks."""


@dataclasses.dataclass
class DistillResult:
    student: nnx.Module  # the same module that was passed in, trained in place
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

    @property
    def full_history(self) -> list[dict[str, Any]]:
        """One record per step of the whole run, across resumes (`history` holds this call's steps only)."""
        return self.resumed_history + self.history

    @property
    def full_evals(self) -> list[dict[str, Any]]:
        return self.resumed_evals + self.evals


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
    cfg = getattr(model, "config", None)
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
            raise ValueError("attention/feature losses need a layer map: set DistillConfig.correspondence or plan.")
        corr = Correspondence(tuple((round((j + 1) * t_depth / s_depth) - 1, j) for j in range(s_depth)))
    t_depth, s_depth = _depth(teacher), _depth(student)
    if t_depth is not None and s_depth is not None:
        corr.validate(t_depth, s_depth)
    return corr


DEFAULT_LOGIT_BLOCK = 256  # rows: teacher logits and head-gradient matmuls at least this tall (CPU: 2x faster)
CPU_LOGIT_CHUNK = 128  # rows: 270M step on the 2-core CPU 4.24 s at 32 rows, 4.07-4.22 at 64, 4.03-4.07 at 128
# (256-row blocks, closed-form gradient; +22 MB peak RSS)
ACCELERATOR_LOGIT_CHUNK = 2048  # rows: on an H200, 2048 and 8192 were 1.6 % apart; 32 would read the head per chunk


def logit_chunk(config: DistillConfig, device: jax.Device | None = None) -> int:
    """Rows per chunk of the fused loss: `config.logit_chunk` when set; else 128 on CPU, and on an accelerator
    2048 rows, halved (down to 256) until one (rows, 262144) float32 block (a Gemma 3 vocabulary) takes at most
    1/32 of the device's memory: 2048 on 80-141 GB GPUs, 512 on a 16 GB TPU v5e. Small chunks on a GPU make the
    student's logits matmul read the whole (V, D) head for a few rows at a time."""
    if config.logit_chunk:
        return config.logit_chunk
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return CPU_LOGIT_CHUNK
    stats = device.memory_stats() or {}
    return accelerator_logit_chunk(stats.get("bytes_limit"))


def accelerator_logit_chunk(device_bytes: int | None, vocab: int = 262144) -> int:
    rows = ACCELERATOR_LOGIT_CHUNK
    while device_bytes and rows > DEFAULT_LOGIT_BLOCK and rows * vocab * 4 > device_bytes / 32:
        rows //= 2
    return rows


def logit_block(config: DistillConfig) -> int:
    """Rows per teacher-logits / head-gradient block of the fused loss: `config.logit_block` when set, else
    max(chunk, 256). Costs one (block, V) float32 buffer; when the block covers the whole batch it also saves
    the (V, D) accumulator."""
    return max(logit_chunk(config), config.logit_block or DEFAULT_LOGIT_BLOCK)


def logit_vocab_slice(config: DistillConfig) -> int | None:
    """Vocabulary rows per head-gradient matmul of the fused loss: `config.logit_vocab_slice` when set, else
    32768 on CPU (XLA:CPU copies the (block, V) gradient transposed for that matmul; slices bound the copy at no
    measured cost) and None elsewhere (one matmul: GPU and TPU matmuls read either layout)."""
    if config.logit_vocab_slice:
        return config.logit_vocab_slice
    return 32768 if jax.default_backend() == "cpu" else None


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc's `malloc_trim`; a no-op elsewhere). Loading a checkpoint frees
    large read buffers that glibc keeps in the heap (0.75 GiB after loading a 1 GB teacher, measured); XLA's big
    step buffers are mmap-allocated and never reuse them, so they only add to the run's peak RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


def _shardings(tree: Any, mesh) -> Any:
    return jax.tree.map(lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else _replicated(mesh), tree)


def _put_like(values: Any, template: Any) -> Any:
    """Host or device values onto the dtypes and shardings of `template` (same structure); host arrays go
    straight to their shards, never through one device."""
    def put(value, like):
        if isinstance(value, jax.Array):
            value = value if value.dtype == like.dtype else value.astype(like.dtype)
        else:
            value = np.asarray(value, dtype=like.dtype)
        return jax.device_put(value, like.sharding)
    return jax.tree.map(put, values, template)


def _donatable(tree: Any, stepped: set[int]) -> Any:
    """`tree` with every leaf that is not a step output (ids in `stepped`) replaced by an XLA-made copy.

    XLA:CPU adopts host buffers without copying (the loader's aligned reads, `device_put` of numpy), and such a
    buffer is never reused for the donated step's outputs: the step then allocates every output anew while the
    inputs stay alive, one extra copy of the trainable parameters at the peak (0.7 GB for the 270M benchmark's
    student, measured). A copy costs one memcpy per stage entry, leaf by leaf. It also keeps teacher buffers the
    student shares (tied or copied layers) out of the donation."""
    return jax.tree.map(lambda x: x if id(x) in stepped else jnp.copy(x), tree)


class Session:
    """Holds the split student, optimizer state and compiled steps of the current stage."""

    def __init__(self, teacher, student, config: DistillConfig, mesh, correspondence, projections):
        self.config, self.mesh, self.student = config, mesh, student
        self.correspondence = correspondence
        self.teacher_graph, self.teacher_state = nnx.split(teacher) if teacher is not None else (None, None)
        opt = config.optimizer
        self.adam_settings = AdamSettings(b1=opt.b1, b2=opt.b2, eps=opt.eps)
        self.adam = self.adam_settings.transform()
        self.stage_index: int | None = None
        self.params: dict[str, Any] | None = None
        self.frozen = self.opt = self.graph = None
        self.projections = projections
        self._compiled: dict[int, Any] = {}
        self._lowered: list[Any] = []  # (stage, batch shapes) already compiled

    def spec(self, index: int) -> StepSpec:
        config, weights = self.config, self.config.stages[index].weights
        logit = LogitLossSpec(kl=weights.kl != 0, reverse_kl=weights.reverse_kl != 0, jsd=weights.jsd != 0,
                              ce=weights.ce != 0, jsd_beta=config.jsd_beta, top_k=config.top_k,
                              chunk=logit_chunk(config), block=logit_block(config),
                              vocab_slice=logit_vocab_slice(config),
                              unit_temperature=config.unit_temperature, teacher=self.teacher_graph is not None,
                              diagnostics=config.train_diagnostics)
        return StepSpec(logit=logit, attention=weights.attention != 0, feature=weights.feature != 0,
                        correspondence=self.correspondence, feature_kind=config.feature_kind,
                        logit_impl=config.logit_impl, compute_dtype=jnp.dtype(config.compute_dtype),
                        remat=config.remat, clip_norm=config.optimizer.clip_norm,
                        decay_matrices_only=config.optimizer.decay_matrices_only)

    def sync_student(self) -> None:
        """Write the current trainable values back into the student module."""
        if self.params is not None:
            nnx.update(self.student, self.params["student"])

    def enter_stage(self, index: int, *, carry: bool) -> int:
        """Split the student for stage `index`; returns how many optimizer-state leaves were carried over."""
        self.sync_student()
        stage = self.config.stages[index]
        stepped = {id(x) for x in jax.tree.leaves(self.params)} if self.params is not None else set()
        self.graph, trainable, self.frozen = freeze.split_trainable(self.student, stage.trainable, stage.frozen)
        trainable = _donatable(trainable, stepped)
        nnx.update(self.student, trainable)  # the module lets go of the loader's buffers
        projections = _donatable(self.params["proj"] if self.params is not None else self.projections, stepped)
        params = {"student": trainable, "proj": projections}
        opt_state = self.adam.init(params)
        carried = 0
        if carry and self.opt is not None:
            opt_state, carried = freeze.carry_matching(opt_state, self.opt)
        if self.mesh is not None:
            params = jax.tree.map(jax.device_put, params, _shardings(params, self.mesh))
            opt_state = jax.tree.map(jax.device_put, opt_state, _shardings(opt_state, self.mesh))
        else:  # commit everything to the student's device (Adam's step counter is made uncommitted): the step's
            # outputs are committed, and a committed input recompiles the step at its second call
            device = next(iter(jax.tree.leaves(params)[0].devices()))
            params, opt_state = jax.device_put((params, opt_state), device)
        self.params, self.opt, self.stage_index = params, opt_state, index
        self.warmup = True  # the next step may include compilation
        if index not in self._compiled:
            spec = self.spec(index)
            out = None
            if self.mesh is not None:
                out = (_shardings(params, self.mesh), _shardings(opt_state, self.mesh), _replicated(self.mesh))
            self._compiled[index] = build_train_step(self.graph, self.teacher_graph, spec, self.adam_settings, out,
                                                     self.config.compiler_options)
        return carried

    def train_step(self, batch, hyper) -> dict[str, Any]:
        train_fn = self._compiled[self.stage_index]
        args = (self.params, self.opt, self.frozen, self.teacher_state, batch, hyper)
        signature = (self.stage_index, jax.tree.map(lambda x: (x.shape, x.dtype), batch))
        if signature not in self._lowered:
            # Compile ahead of the first call (the call then reuses the executable) and return the compiler's
            # freed memory before the step allocates its buffers: otherwise both count in the peak RSS.
            train_fn.lower(*args).compile()
            release_free_heap()
            self._lowered.append(signature)
        self.params, self.opt, step_metrics = train_fn(*args)
        return step_metrics

    def evaluate(self, batch) -> dict[str, Any]:
        """Held-out logit metrics of the current student (temperature 1, stage independent)."""
        evaluate = build_eval_step(self.graph, self.teacher_graph, logit_chunk(self.config),
                                   self.config.compiler_options)
        return evaluate(self.full_state(), self.teacher_state, batch)

    # ---- snapshots (checkpoints, rollback) ---------------------------------------------------------------
    def full_state(self) -> nnx.State:
        self.sync_student()
        return nnx.state(self.student)

    def load(self, stage_index: int, student_state: Any, opt_state: Any, projections: dict) -> None:
        """Install saved values (host or device) for stage `stage_index`, on the current devices."""
        self.sync_student()
        nnx.update(self.student, _put_like(student_state, nnx.state(self.student)))
        self.params = None
        if projections:
            self.projections = _put_like(projections, self.projections)
        self.enter_stage(stage_index, carry=False)
        self.opt = _donatable(_put_like(opt_state, self.opt), set())


def run(teacher: nnx.Module, student: nnx.Module, data: Any, config: DistillConfig, *,
        eval_data: Any = None) -> DistillResult:
    """Distil `teacher` into `student` (trained in place) following `config`.

    `teacher`, `student`: NNX modules with the DistillModel interface (interface.py); the teacher is never trained
    and may be in a lower precision. `teacher=None` trains the student on hard labels alone (every stage may only
    weight `ce`), e.g. to make a small teacher for demos. With `config.mesh` both are placed on the mesh by their
    `axes` metadata unless they already live there. `data`: an object with `next_batch()` (optionally `state()`/
    `restore()` and `eval_batches()`), or an iterable of dicts with `input_ids` (B, T) int32, optional `loss_mask`
    (B, T) (`loss_mask[b, t]` weights the prediction made at position t of token t + 1) and `attention_mask`.
    `eval_data`: held-out batches (default: `data.eval_batches()` when it exists). Returns a DistillResult with
    per-step metrics, evaluations and events (stage switches, rollbacks, resume).

    With `config.checkpoint.directory` set, a run resumes from the newest complete checkpoint there. A first
    SIGINT (Ctrl-C) or SIGTERM finishes the current step, checkpoints it and raises RunInterrupted (a
    KeyboardInterrupt) saying which step was saved and how to resume; a second one stops at once."""
    from .run_loop import Loop  # imports DivergenceError from here

    check_model(student, "student")
    if teacher is None:
        needy = [s.name or str(i) for i, s in enumerate(config.stages) if s.weights.active() - {"ce"}]
        if needy:
            raise ValueError(f"teacher=None trains on hard labels only, but stage(s) {needy} weight teacher losses; "
                             "set their kl/reverse_kl/jsd/attention/feature weights to 0 or pass a teacher.")
    else:
        check_model(teacher, "teacher")
        (v_t, d_t), (v_s, d_s) = teacher.head_matrix().shape, student.head_matrix().shape
        if v_t != v_s:
            raise ValueError(f"the teacher's vocabulary has {v_t} entries and the student's {v_s}; logit "
                             "distillation needs the same tokenizer and vocabulary on both sides.")
    mesh = make_mesh(config.mesh, devices=config.mesh_devices) if config.mesh is not None else None
    check_mesh_fits(mesh, {"teacher": teacher, "student": student},
                    None if config.batch_size is None else config.batch_size)
    if mesh is not None:
        for model in (teacher, student):
            if model is not None and not model_on_mesh(model, mesh):
                shard_model(model, mesh)
    needs_map = any(s.weights.attention or s.weights.feature for s in config.stages)
    corr = resolve_correspondence(config, teacher, student) if needs_map else Correspondence()
    projections: dict[str, jax.Array] = {}
    if config.feature_projection and any(s.weights.feature for s in config.stages):
        projections = init_projections(corr, d_s, d_t, config.seed)
        if mesh is not None:
            projections = jax.device_put(projections, _replicated(mesh))
    session = Session(teacher, student, config, mesh, corr, projections)
    release_free_heap()
    loop = Loop(session, DataStream(data), config, mesh, eval_data, teacher, student)
    try:
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            loop.run()
    finally:
        session.sync_student()
        loop.close()
    return DistillResult(student=student, history=loop.history, evals=loop.evals, events=loop.events,
                         projections=session.params["proj"] if session.params else projections,
                         steps=loop.step, run_dir=config.run_dir, resumed_history=loop.resumed_history,
                         resumed_evals=loop.resumed_evals, data_state=loop.data_state)


__all__ = ["run", "DistillResult", "DivergenceError", "RunInterrupted", "DataStream", "Session",
           "resolve_correspondence"]
