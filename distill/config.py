"""Configuration of a distillation run: losses and weights, stages (freeze schedule), optimizer, sizes, mesh,
checkpointing and the divergence guard. Plain frozen dataclasses; `DistillConfig.from_dict` reads the same from
JSON-like dicts (nested dicts for the sub-configs, a list of dicts for `stages`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from .interface import Correspondence
from .losses import FEATURE_KINDS


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms (0 turns a term off and removes its computation from the step).

    kl / reverse_kl / jsd are logit divergences (multiplied by temperature^2), ce is hard-label cross-entropy,
    attention is attention-map transfer and feature is layer-output matching (losses.py)."""

    kl: float = 1.0
    reverse_kl: float = 0.0
    jsd: float = 0.0
    ce: float = 0.0
    attention: float = 0.0
    feature: float = 0.0

    @classmethod
    def mixed(cls, alpha: float, divergence: str = "kl", **others: float) -> "LossWeights":
        """The usual alpha mixing: alpha * divergence + (1 - alpha) * CE."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must lie in [0, 1].")
        base = {"kl": 0.0, divergence: alpha, "ce": 1.0 - alpha, **others}
        return cls(**base)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def active(self) -> frozenset[str]:
        return frozenset(name for name, value in self.as_dict().items() if value != 0.0)


@dataclasses.dataclass(frozen=True)
class Ramp:
    """A value moving from `start` to `end` over a stage, linearly or along a half cosine."""

    start: float
    end: float
    shape: str = "linear"

    def at(self, fraction: float) -> float:
        fraction = min(max(fraction, 0.0), 1.0)
        if self.shape == "cosine":
            fraction = 0.5 * (1.0 - math.cos(math.pi * fraction))
        elif self.shape != "linear":
            raise ValueError(f"Ramp shape {self.shape!r} unknown; use 'linear' or 'cosine'.")
        return self.start + (self.end - self.start) * fraction


def _ramp(value: float | Ramp | Sequence[float]) -> Ramp:
    if isinstance(value, Ramp):
        return value
    if isinstance(value, (tuple, list)):
        return Ramp(float(value[0]), float(value[1]), *(value[2:]))
    return Ramp(float(value), float(value))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One phase of a progressive schedule: its trainable set, learning rate, loss weights and length.

    `trainable` / `frozen`: path patterns or NNX filters (freeze.py); None trains every parameter. The learning
    rate warms up linearly for `warmup_steps`, then follows a cosine from `learning_rate` down to
    `learning_rate * min_lr_ratio` at the end of the stage. `temperature` is a number or (start, end)."""

    steps: int
    trainable: Any = None
    frozen: Any = None
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weights: LossWeights = LossWeights()
    temperature: Any = 1.0
    weight_decay: float | None = None  # None: OptimizerConfig.weight_decay
    name: str = ""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"Stage {self.name or ''}: steps={self.steps} must be at least 1.")
        if self.learning_rate < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"Stage {self.name or ''}: learning_rate must be >= 0 and min_lr_ratio in [0, 1].")
        if isinstance(self.weights, dict):
            object.__setattr__(self, "weights", LossWeights(**self.weights))
        if not self.weights.active():
            raise ValueError(f"Stage {self.name or ''}: every loss weight is 0; nothing would be trained.")
        object.__setattr__(self, "temperature", _ramp(self.temperature))
        if min(self.temperature.start, self.temperature.end) <= 0:
            raise ValueError(f"Stage {self.name or ''}: temperature must stay positive.")

    def learning_rate_at(self, step_in_stage: int) -> float:
        if step_in_stage < self.warmup_steps:
            return self.learning_rate * (step_in_stage + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        fraction = min(1.0, (step_in_stage - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return self.learning_rate * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def temperature_at(self, step_in_stage: int) -> float:
        return self.temperature.at(step_in_stage / max(1, self.steps - 1))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax.scale_by_adam + decoupled weight decay) with global-norm clipping."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = 1.0
    decay_matrices_only: bool = True  # no decay on norm scales and other vectors


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of student, optimizer state and data position in `directory` every `every` steps."""

    directory: str | None = None
    every: int = 100
    keep: int = 2
    resume: bool = True  # continue from the latest checkpoint in `directory` when there is one


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Divergence guard: a non-finite loss, or one above `spike_factor` x the running median of the last `window`
    good steps (once `min_history` are known), rolls back to the last good state and multiplies the learning
    rate by `lr_backoff`. After `max_rollbacks` the run stops with DivergenceError."""

    enabled: bool = True
    spike_factor: float = 4.0
    window: int = 32
    min_history: int = 8
    lr_backoff: float = 0.5
    max_rollbacks: int = 3


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    stages: tuple[Stage, ...] = (Stage(steps=100),)
    batch_size: int | None = None  # expected global micro-batch shape; None accepts the data's shape
    seq_len: int | None = None
    grad_accum: int = 1  # micro-batches per optimizer step, all inside one jitted step
    optimizer: OptimizerConfig = OptimizerConfig()
    # logit loss
    top_k: int | None = None
    jsd_beta: float = 0.5
    logit_chunk: int | None = None  # rows (batch x positions) per chunk of the fused logit loss; None: 128 on
    # CPU, up to 2048 on an accelerator as its memory allows (`distill.trainer.logit_chunk`)
    logit_block: int | None = None  # rows per teacher-logits / head-gradient matmul; None: max(chunk, 256)
    logit_vocab_slice: int | None = None  # vocab rows per head-gradient matmul; None: 32768 on CPU, whole on GPU
    train_diagnostics: bool = False  # teacher CE / logit correlation / T=1 KL every train step (eval has them)
    logit_impl: str = "fused"  # or "reference" (materialises full logits; for debugging)
    # intermediate losses
    correspondence: Correspondence | None = None  # None: from `plan`, else identity when depths agree
    plan: Any = None  # an object or dict with kept_layers / kept_hidden (surgery plan)
    feature_kind: str = "nmse"
    feature_projection: bool = False  # learned (D_s, D_t) projections for students of another width
    # numerics and placement
    compute_dtype: str = "float32"  # "bfloat16": bf16 student forward/backward, float32 master weights
    remat: str | None = None  # None, "full" or "dots": rematerialise the student forward
    mesh: Any = None  # "fsdp=4,tp=2", {"fsdp": 4, "tp": 2}, a jax Mesh, or None (one device)
    mesh_devices: int | None = None  # run the mesh on the first N devices only (None: sizes must use them all)
    compiler_options: dict | None = None  # XLA options for the step, e.g. {"xla_backend_optimization_level": 0}
    # bookkeeping
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    run_dir: str | None = None  # JSONL metrics, TensorBoard events and PNG curves
    eval_every: int | None = None  # steps between held-out evaluations (also run at start and end)
    eval_batches: int = 8
    progress: bool = True
    plots: bool = True
    peak_flops: float | None = None  # per device; None: known accelerator table (metrics.py), else no MFU
    halt_after: int | None = None  # stop after this global step as if interrupted (tests, time-sliced jobs)
    seed: int = 0

    def __post_init__(self):
        stages = tuple(Stage(**s) if isinstance(s, dict) else s for s in self.stages)
        if not stages:
            raise ValueError("DistillConfig needs at least one Stage.")
        object.__setattr__(self, "stages", stages)
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum} must be at least 1 micro-batch per step.")
        for name in ("logit_chunk", "logit_block", "logit_vocab_slice"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive number of rows, or None.")
        if self.logit_impl not in ("fused", "reference"):
            raise ValueError(f"logit_impl={self.logit_impl!r}: use 'fused' or 'reference'.")
        if self.feature_kind not in FEATURE_KINDS:
            raise ValueError(f"feature_kind={self.feature_kind!r}: choose from {FEATURE_KINDS}.")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype={self.compute_dtype!r}: use 'float32' or 'bfloat16'.")
        if self.remat not in (None, "full", "dots"):
            raise ValueError(f"remat={self.remat!r}: use None, 'full' or 'dots'.")
        self._check_mesh()
        if self.top_k is not None and any(s.weights.reverse_kl for s in stages):
            raise ValueError("top_k cannot be combined with a reverse_kl weight (infinite on truncated support).")

    def _check_mesh(self) -> None:
        """Mesh spec and batch checked when the config is made, not after the models are loaded (MeshError)."""
        from .mesh import MeshError, parse_mesh_spec

        if self.mesh_devices is not None and (isinstance(self.mesh_devices, bool)
                                              or not isinstance(self.mesh_devices, int) or self.mesh_devices < 1):
            raise MeshError(f"mesh_devices={self.mesh_devices!r} must be a positive number of devices, or None.")
        if self.mesh is None or not isinstance(self.mesh, (str, dict)):
            return
        sizes = parse_mesh_spec(self.mesh)
        if self.mesh_devices is not None and math.prod(sizes.values()) != self.mesh_devices:
            raise MeshError(f"mesh {self.mesh!r} uses {math.prod(sizes.values())} device(s) but mesh_devices="
                            f"{self.mesh_devices}; make the axis sizes multiply to mesh_devices.")
        split = math.prod(size for axis, size in sizes.items() if axis in ("data", "fsdp"))
        if self.batch_size is not None and self.batch_size % split:
            raise MeshError(f"batch_size={self.batch_size} does not split over the mesh's data axes ({split} "
                            f"devices in {self.mesh!r}); use a multiple of {split}.")

    @property
    def total_steps(self) -> int:
        return sum(stage.steps for stage in self.stages)

    def stage_at(self, step: int) -> tuple[int, int]:
        """(stage index, step within the stage) of global step `step` (0-based)."""
        for index, stage in enumerate(self.stages):
            if step < stage.steps:
                return index, step
            step -= stage.steps
        return len(self.stages) - 1, self.stages[-1].steps

    @property
    def unit_temperature(self) -> bool:
        return all(s.temperature.start == 1.0 and s.temperature.end == 1.0 for s in self.stages)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DistillConfig":
        data = dict(data)
        nested = {"optimizer": OptimizerConfig, "checkpoint": CheckpointConfig, "guard": GuardConfig}
        for key, kind in nested.items():
            if isinstance(data.get(key), dict):
                data[key] = kind(**data[key])
        if isinstance(data.get("correspondence"), dict):
            data["correspondence"] = Correspondence(**data["correspondence"])
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"DistillConfig: unknown keys {sorted(unknown)}.")
        data["stages"] = tuple(Stage(**s) if isinstance(s, dict) else s for s in data.get("stages", cls.stages))
        return cls(**data)


__all__ = ["DistillConfig", "Stage", "LossWeights", "Ramp", "OptimizerConfig", "CheckpointConfig", "GuardConfig"]
