"""`StepRunner`: the student's training state for the current stage, and the compiled steps that advance it.

It owns the trainable parameters (split from the student by the stage's trainable set), the optimizer state,
the learned projections and the compiled train and evaluation steps. The loop (driver.py) decides when to step,
enter a stage, checkpoint or roll back; the runner does it.

Buffer ownership: the step donates the trainable parameters; on entering a stage, those not made by the step are
replaced by XLA-made copies (in the student module too: see `_donatable`), which the first step consumes; the
module is written back (`sync_student`) at stage switches, checkpoints and the end of the run, also when the run
stops with an error. The trainable parameters are float32 master weights whatever the student's dtype
(`freeze.master_dtype`); the run gives the student back in its own dtypes (`give_back`).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from . import freeze
from ..losses import term_registry as terms
from .run_config import DistillConfig
from ..losses.logit_term import LOGIT, chosen_loss, logit_chunk
from ..losses.tpu_kernel import model_caps
from ..losses.logit_term import (accelerator_logit_chunk, logit_block, logit_vocab_slice)  # noqa: F401 - importable here too
from ..mesh import replicated
from .oom import CompileRequest, run_compile_hooks
from .train_step import AdamSettings, StepSettings, build_eval_step, build_train_step


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc's `malloc_trim`; a no-op elsewhere). Loading a checkpoint frees
    large read buffers that glibc keeps in the heap; XLA's big step buffers are mmap-allocated and never reuse
    them, so they only add to the run's peak RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _shardings(tree: Any, mesh) -> Any:
    return jax.tree.map(lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else replicated(mesh), tree)


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
    """`tree` with every leaf that is not a step output (ids in `stepped`) replaced by an XLA-made copy, in
    float32 where it was narrower (`freeze.master_dtype`).

    XLA:CPU adopts host buffers without copying (the loader's aligned reads, `device_put` of numpy), and such a
    buffer is never reused for the donated step's outputs: the step then allocates every output anew while the
    inputs stay alive, one extra copy of the trainable parameters at the peak. A copy costs one memcpy per stage
    entry, leaf by leaf. It also keeps teacher buffers the student shares (tied or copied layers) out of the
    donation."""
    return jax.tree.map(lambda x: x if id(x) in stepped else jnp.array(x, freeze.master_dtype(x.dtype), copy=True),
                        tree)


# JAX's own event for an executable its persistent compilation cache supplied, counted for the whole process (one
# listener, registered again by `listen_for_compiles` if another library cleared it). With a cache folder set, a
# compile during which it fired is a "hit", any other a "miss"; with none set, neither is recorded.
# JAX's event around every executable it builds or loads from that cache (none when it reuses one this process
# already holds, e.g. compiled ahead: lowering.compile_ahead), counted likewise.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_cache_counts = {"hits": 0, "compiles": 0}


def _count_cache_event(event: str, **_: Any) -> None:
    if event == _CACHE_HIT:
        _cache_counts["hits"] += 1


def _count_compile(event: str, duration_secs: float, **_: str | int) -> None:
    if event == _BACKEND_COMPILE:
        _cache_counts["compiles"] += 1


def listen_for_compiles() -> None:
    """(Re-)register the two counters. Another library may have cleared every listener of the process (Tunix's
    metrics logger calls `jax.monitoring.clear_event_listeners()` when it closes), and a compile nobody counted
    would read as reused; the runner calls this before each compile it reports."""
    with contextlib.suppress(AssertionError, ValueError):  # not registered (any more)
        jax.monitoring.unregister_event_listener(_count_cache_event)
    jax.monitoring.register_event_listener(_count_cache_event)
    with contextlib.suppress(AssertionError, ValueError):
        jax.monitoring.unregister_event_duration_listener(_count_compile)
    jax.monitoring.register_event_duration_secs_listener(_count_compile)


listen_for_compiles()


def compile_report(compiled: Any, seconds: float, hits_before: int | None = None,
                   compiles_before: int | None = None) -> dict[str, Any]:
    """What the step's compile took (a persistent compilation cache hit takes well under a second), whether the
    persistent cache supplied it (`compile_cache`: "hit" or "miss"; absent where the cache is off), whether the
    process already held the executable (`compile_reused`: no compile and no cache load, e.g. compiled ahead),
    and XLA's memory analysis of the executable the run then calls: per device, arguments + temporaries + outputs
    not aliased to an argument. On a TPU that is what the chip holds for the step (`bytes_in_use +
    bytes_reserved`)."""
    report: dict[str, Any] = {"compile_s": round(seconds, 3)}
    if compiles_before is not None and _cache_counts["compiles"] == compiles_before:
        report["compile_reused"] = True  # neither compiled nor looked up in the persistent cache
    elif hits_before is not None and getattr(jax.config, "jax_compilation_cache_dir"):
        report["compile_cache"] = "hit" if _cache_counts["hits"] > hits_before else "miss"
    try:
        memory = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (a backend without the analysis: the time alone)
        return report
    if memory is not None:
        report["compiled_temp_bytes"] = int(memory.temp_size_in_bytes)
        report["compiled_bytes"] = int(memory.argument_size_in_bytes + memory.temp_size_in_bytes
                                       + memory.output_size_in_bytes - memory.alias_size_in_bytes)
    return report


class StepRunner:
    """The student's training state for the current stage (trainable parameters, frozen rest, optimizer state,
    projections) and the compiled steps that advance it. `first_step_of_stage` is true until the first train step
    after entering a stage (or restoring one) has run: that step may include compilation."""

    def __init__(self, teacher, student, config: DistillConfig, mesh, correspondence, projections):
        self.config, self.mesh, self.student = config, mesh, student
        self.given_dtypes = jax.tree.map(lambda x: x.dtype, nnx.state(student, nnx.Param))  # given back in these
        self.correspondence = correspondence
        self.teacher = teacher
        self.teacher_graph, self.teacher_state = nnx.split(teacher) if teacher is not None else (None, None)
        opt = config.optimizer
        self.adam_settings = AdamSettings(b1=opt.b1, b2=opt.b2, eps=opt.eps)
        self.adam = self.adam_settings.transform()
        self.stage_index: int | None = None
        self.params: dict[str, Any] | None = None
        self.graph: nnx.GraphDef | None = None  # the stage's split of the student (enter_stage)
        self.frozen: nnx.State | None = None
        self.opt: Any = None  # the optimizer's state (an optax pytree)
        self.projections = projections
        self.first_step_of_stage = False
        self._compiled: dict[int, Any] = {}
        self._lowered: list[Any] = []  # (stage, batch shapes) already compiled
        self.remat = config.remat  # the OOM handling may raise it (set_remat)
        self.policies = config.guard.policies if config.guard.enabled else ()
        self.compile_report: dict[str, Any] = {}

    def step_settings(self, index: int) -> StepSettings:
        """The static settings of stage `index`'s step: the terms its weights turn on (and those the run's
        fallbacks may switch on), each term's options, the logit loss's kinds and chunking, numerics."""
        config = self.config
        policies = self.policies if self.teacher_graph is not None else ()
        weights = terms.compiled_weights(config.stages[index].weights, policies)
        computed = [term for term in terms.active_terms(weights) if term is not LOGIT]
        cached = config.teacher_cache is not None and self.teacher_graph is None
        return StepSettings(logit=LOGIT.loss_settings(config, weights, self.teacher_graph is not None or cached),
                            cached_teacher=cached,
                            terms=tuple(term.name for term in computed), correspondence=self.correspondence,
                            options={term.name: terms.option_values(term, config) for term in computed
                                     if term.options},
                            logit_impl=self.logit_impl(), compute_dtype=jnp.dtype(config.compute_dtype),
                            remat=self.remat, attention_kernel=self.attention_kernel(),
                            clip_norm=config.optimizer.clip_norm,
                            decay_matrices_only=config.optimizer.decay_matrices_only)

    def on_tpu(self) -> bool:
        device = self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]
        return device.platform == "tpu"

    def logit_impl(self) -> str:
        """The step's logit loss (`StepSettings.logit_impl`): "fused" is the TPU kernels on TPU devices
        (`distill.losses.tpu_kernel`, where they apply) and XLA's chunked loss elsewhere; "fused_xla" always the
        latter; "kernel" the kernels, interpreted off a TPU."""
        wanted = self.config.logit_impl
        if wanted == "fused_xla":
            return "fused"
        if wanted in ("fused", "kernel"):
            return "kernel" if self.on_tpu() else ("fused" if wanted == "fused" else "kernel_interpret")
        return wanted

    def logit_loss(self, index: int) -> str:
        """Which logit loss stage `index`'s step computes, for its compile record (`logit_term.chosen_loss`, the
        choice the logit term makes when it is traced)."""
        settings = self.step_settings(index)
        vocab = getattr(getattr(self.student, "config", None), "vocab_size", None) or \
            self.student.head_matrix().shape[0]
        caps = model_caps(self.student, None if settings.cached_teacher else self.teacher)
        return chosen_loss(settings.logit_impl, settings.logit, settings.cached_teacher, vocab, caps,
                           self.mesh.size if self.mesh is not None else 1)

    def attention_kernel(self) -> str:
        """The step's attention: `config.attention_kernel`, where "auto" is the splash kernel on TPU devices."""
        wanted = self.config.attention_kernel
        if wanted != "auto":
            return wanted
        return "splash" if self.on_tpu() else "xla"

    def current_student(self) -> nnx.Module:
        """The student as it is now: a module merged from the stage's trainable values and the frozen rest,
        sharing their arrays (host-side work such as on-policy sampling). The next train step donates those
        arrays, so use it before dispatching that step and do not keep it."""
        if self.graph is None or self.params is None:
            raise RuntimeError("no stage entered yet (StepRunner.enter_stage splits the student).")
        return nnx.merge(self.graph, self.params["student"], self.frozen)

    def sync_student(self) -> None:
        """Write the current trainable values back into the student module."""
        if self.params is not None:
            nnx.update(self.student, self.params["student"])

    def give_back(self) -> None:
        """The end of the run: the student module holds its trained values in the dtypes it came in (a bfloat16
        student trains float32 master weights and is given back in bfloat16)."""
        self.sync_student()
        freeze.cast_back(self.student, self.given_dtypes)

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
        self.first_step_of_stage = True
        self._build(index)
        return carried

    def _build(self, index: int) -> None:
        if index in self._compiled:
            return
        out = None
        if self.mesh is not None:
            out = (_shardings(self.params, self.mesh), _shardings(self.opt, self.mesh), replicated(self.mesh))
        self._compiled[index] = build_train_step(self.graph, self.teacher_graph, self.step_settings(index),
                                                 self.adam_settings, out, self.config.compiler_options)

    def set_remat(self, remat: str | None) -> None:
        """Rematerialise the student forward from now on (the OOM handling): the steps are rebuilt."""
        self.remat = remat
        self._compiled.clear()
        self._lowered.clear()
        if self.stage_index is not None:
            self._build(self.stage_index)

    def state_lost(self) -> bool:
        """Whether a failed step already consumed (donated) the training state, which must then be restored."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((self.params, self.opt)))

    def train_step(self, batch, hyper) -> tuple[dict[str, Any], bool]:
        """Run one optimizer step (dispatched asynchronously): (metrics on the device, whether it was the first
        step of the stage, which may include compilation)."""
        train_fn = self._compiled[self.stage_index]
        args = (self.params, self.opt, self.frozen, self.teacher_state, batch, hyper)
        signature = (self.stage_index, jax.tree.map(lambda x: (x.shape, x.dtype), batch))
        if signature not in self._lowered:
            accum, rows = batch["input_ids"].shape[:2]
            if self.stage_index is None:
                raise RuntimeError("no stage entered yet (StepRunner.enter_stage compiles its step).")
            run_compile_hooks(CompileRequest(self.stage_index, self.remat, int(rows), int(accum)))
            listen_for_compiles()
            # Compile ahead of the first call (the call then reuses the executable) and return the compiler's
            # freed memory before the step allocates its buffers: otherwise both count in the peak RSS.
            started, hits_before, compiles_before = time.perf_counter(), _cache_counts["hits"], _cache_counts["compiles"]
            compiled = train_fn.lower(*args).compile()
            self.compile_report = compile_report(compiled, time.perf_counter() - started, hits_before,
                                                 compiles_before)
            self.compile_report["logit_loss"] = self.logit_loss(self.stage_index)
            release_free_heap()
            self._lowered.append(signature)
        self.params, self.opt, step_metrics = train_fn(*args)
        first, self.first_step_of_stage = self.first_step_of_stage, False
        return step_metrics, first

    def take_compile_report(self) -> dict[str, Any]:
        """The last compile's report (`compile_report`), once: the step that compiled logs it."""
        report, self.compile_report = self.compile_report, {}
        return report

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




__all__ = ["StepRunner", "logit_chunk", "accelerator_logit_chunk", "logit_block",
           "logit_vocab_slice", "release_free_heap"]
