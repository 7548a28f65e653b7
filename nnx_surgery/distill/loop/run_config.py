"""Configuration of a distillation run: losses and weights, stages (freeze schedule), optimizer, sizes, mesh,
checkpointing and the divergence guard. Plain frozen dataclasses; `DistillConfig.from_dict` reads the same from
JSON-like dicts (nested dicts for the sub-configs, a list of dicts for `stages`)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import optax

from ...field_docs import documented
from ...shared_settings import distill_top_k
from ..losses import term_registry as terms
from ..interface import Correspondence
from ..losses.term_weights import LossWeights, Ramp, _plain, _ramp
from .on_policy import OnPolicyConfig
from .subconfigs import (COUNT, COUNT0, GUARD_POLICIES, LOGIT_IMPLS, OOM_CHOICES, OOM_STEPS, REMAT, SHARE, CheckpointConfig,
                         GuardConfig, OOMConfig, OptimizerConfig, TargetsConfig, _checked)
from ..trimmed_vocab import checked_vocab_map
from nnx_surgery.distill.losses.topk_teacher import check_mode
from nnx_surgery.distill.mesh import MeshError, parse_mesh_spec


@dataclasses.dataclass(frozen=True)
class Stage:
    """One phase of a progressive schedule: its trainable set, learning rate, loss weights and length.

    `trainable` / `frozen`: path patterns or NNX filters (freeze.py); None trains every parameter. The learning
    rate warms up linearly for `warmup_steps`, then follows a cosine from `learning_rate` down to
    `learning_rate * min_lr_ratio` at the end of the stage. `temperature` is a number or (start, end); loss
    weights may ramp the same way (LossWeights).

    The length is `steps` (optimizer steps) or `epochs` of the training data (e.g. 0.5): epochs become steps
    when the run starts (`distill.loop.schedules.resolve_epochs`), from the data's rows per epoch, the batch size and
    the gradient accumulation; the resolved stage keeps both."""

    steps: int | None = None
    trainable: Any = None
    frozen: Any = None
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weights: LossWeights = LossWeights()
    temperature: Any = 1.0
    weight_decay: float | None = None  # None: OptimizerConfig.weight_decay
    name: str = ""
    epochs: float | None = None  # the length in epochs of the data; `steps` is then filled in at the start

    def __post_init__(self):
        if self.steps is None and self.epochs is None:
            raise ValueError(f"{self.label}: give its length as steps=N or epochs=X.")
        if self.steps is not None and (not isinstance(self.steps, numbers.Real) or isinstance(self.steps, bool)
                                       or not self.steps < math.inf or int(self.steps) != self.steps
                                       or self.steps < 1):
            raise ValueError(f"{self.label}: steps={self.steps} must be a whole number, at least 1.")
        if self.epochs is not None and not (isinstance(self.epochs, numbers.Real) and 0 < self.epochs < math.inf):
            raise ValueError(f"{self.label}: epochs={self.epochs} must be a positive number.")
        if not 0 <= self.learning_rate < math.inf or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{self.label}: learning_rate must be finite and >= 0, min_lr_ratio in [0, 1].")
        if not isinstance(self.weights, LossWeights):
            object.__setattr__(self, "weights", LossWeights(self.weights))
        if not self.weights.active():
            raise ValueError(f"{self.label}: every loss weight is 0; nothing would be trained.")
        object.__setattr__(self, "temperature", _ramp(self.temperature, f"{self.label}: temperature"))
        for key in ("trainable", "frozen"):  # lists of patterns as tuples: hashable, equal after a JSON trip
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if not all(0 < value < math.inf for value in (self.temperature.start, self.temperature.end)):
            raise ValueError(f"{self.label}: temperature must stay positive and finite.")

    def learning_rate_schedule(self) -> optax.Schedule:
        """Linear warm-up reaching `learning_rate` at step `warmup_steps - 1` (step s of the warm-up gets
        (s + 1) / warmup_steps of it, so the first step does not get 0), then optax's cosine decay to
        `learning_rate * min_lr_ratio` at the end of the stage."""
        warmup = optax.linear_schedule(0.0, self.learning_rate, max(1, self.warmup_steps))
        decay = optax.cosine_decay_schedule(self.learning_rate, max(1, self.length - self.warmup_steps),
                                            alpha=self.min_lr_ratio)
        return optax.join_schedules([lambda step: warmup(step + 1), decay], [self.warmup_steps])

    def learning_rate_at(self, step_in_stage: int) -> float:
        return float(self.learning_rate_schedule()(step_in_stage))

    def temperature_at(self, step_in_stage: int) -> float:
        return self.temperature.at(self.fraction_at(step_in_stage))

    def weights_at(self, step_in_stage: int) -> dict[str, float]:
        """Every loss weight at a step of the stage (ramped ones moved along their ramp)."""
        return self.weights.at(self.fraction_at(step_in_stage))

    def fraction_at(self, step_in_stage: int) -> float:
        """How far through the stage a step is: 0 at its first step, 1 at its last."""
        return step_in_stage / max(1, self.length - 1)

    @property
    def label(self) -> str:
        return f"Stage {self.name!r}" if self.name else "Stage"

    @property
    def length(self) -> int:
        """`steps`, refusing a stage given in epochs that was not resolved against the data yet."""
        if self.steps is None:
            raise ValueError(f"{self.label} is {self.epochs} epoch(s) long and not resolved to steps yet:"
                             " call distill.loop.schedules.resolve_epochs(config, data) first, or give steps=N.")
        return self.steps


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Everything a distillation run needs besides its models and data. Each field's help (`documented`) is what
    the recipe's --help prints; the fields with a flag are the recipe's and the subcommands' distillation flags."""

    stages: tuple[Stage, ...] = documented((Stage(steps=100),), "the stages in order: steps or epochs, trainable/"
                                           "frozen patterns, learning_rate, warmup_steps, min_lr_ratio, weights "
                                           "(numbers or [start, end] ramps), temperature, weight_decay, name")
    batch_size: int | None = documented(None, "expected global micro-batch shape", none_means="the data's")
    seq_len: int | None = documented(None, "expected tokens per row", none_means="the data's")
    grad_accum: int = documented(1, "micro-batches per optimizer step, in one jitted step (a bigger batch without "
                                 "its memory)", flag="--grad-accum", kind=int)
    optimizer: OptimizerConfig = documented(OptimizerConfig(), "AdamW moments, decay, gradient clipping")
    # logit loss
    top_k: int | None = distill_top_k()  # the distill subcommand's --top-k too
    top_k_mode: str = documented("renormalised", "renormalised, or residual: the top k plus a bucket for the rest "
                                 "(distill.losses.topk_teacher)")
    teacher_cache: str | None = documented(None, "train from a teacher cache folder (`nnx-surgery cache-teacher`) "
                                           "instead of a teacher (distill.loop.cache_replay)")
    jsd_beta: float = documented(0.5, "JSD's mixture weight beta: 0 is forward KL(teacher||student), 1 reverse KL, "
                                 "0.5 the symmetric JSD", flag="--jsd-beta", kind=float)
    logit_chunk: int | None = documented(None, "rows (batch x positions) per chunk of the fused logit loss (memory)",
                                         none_means="128 on CPU, up to 2048 on an accelerator as its memory allows")
    logit_block: int | None = documented(None, "rows per teacher-logits / head-gradient matmul",
                                         none_means="max(chunk, 256)")
    logit_vocab_slice: int | None = documented(None, "vocabulary rows per head-gradient matmul",
                                               none_means="32768 on CPU, whole on GPU")
    train_diagnostics: bool = documented(False, "teacher CE, logit correlation and T=1 KL every train step (the "
                                         "evaluations have them anyway)")
    logit_impl: str = documented("fused", "fused (never materialises logits; on a TPU the Pallas kernels of "
                                 "distill/losses/tpu_kernel.py where they apply, else XLA's chunked loss), "
                                 "fused_xla (XLA's chunked loss everywhere), kernel (the Pallas kernels, in "
                                 "Pallas' interpreter off a TPU), two_pass (vocabulary slices: no (V, D) "
                                 "accumulator, about 1.5x the loss's matmuls) or reference (full logits, for "
                                 "debugging)")
    # intermediate losses
    correspondence: Correspondence | None = documented(None, "teacher -> student layer map",
                                                       none_means="from the plan, else identity when depths agree")
    plan: Any = documented(None, "an object or dict with kept_layers / kept_hidden (surgery plan)")
    vocab_map: tuple[int, ...] | None = documented(None, "a trimmed student's vocabulary: the teacher token id of "
                                                   "each student token id (distill.trimmed_vocab)",
                                                   none_means="the plan's kept_vocab, else one shared vocabulary")
    feature_projection: bool = documented(False, "learned (D_s, D_t) projections (feature, cosine terms) for "
                                          "another width")
    loss_options: dict = documented(help="the loss terms' options by term name, e.g. {\"feature\": {\"kind\": "
                                    "\"pooled\"}, \"mse\": {\"on\": \"features\"}} (distill.losses.term_registry)",
                                    factory=dict)
    # numerics and placement
    compute_dtype: str = documented("float32", "bfloat16: bf16 student forward/backward, float32 master weights")
    remat: str | None = documented(None, "rematerialise the student forward (memory for compute): layers "
                                   "recomputes each decoder layer in the backward pass, keeping only the residual "
                                   "stream between layers (layers_dots also keeps each layer's matmul outputs); "
                                   "full / dots wrap the whole forward in one checkpoint, which lowers the peak "
                                   "little", flag="--remat", choices=("none", *REMAT), none_means="off",
                                   none_word="none")
    attention_kernel: str = documented("auto", "attention in the train step: splash (the Pallas splash kernel of a "
                                       "TPU: no (B, heads, T, T) scores in memory) or xla; auto: splash where the "
                                       "run's devices are TPUs, xla elsewhere")
    mesh: Any = documented(None, "\"fsdp=4,tp=2\", {\"fsdp\": 4, \"tp\": 2} or a jax Mesh",
                           none_means="one device")
    mesh_devices: int | None = documented(None, "run the mesh on the first N devices only",
                                          none_means="every device")
    compiler_options: dict | None = documented(None, "XLA options for the step, e.g. "
                                               "{\"xla_backend_optimization_level\": 0}")
    # bookkeeping
    checkpoint: CheckpointConfig = documented(CheckpointConfig(), "every / keep")
    guard: GuardConfig = documented(GuardConfig(), "divergence guard and its fallbacks (policies, mse_*, sft_*)")
    targets: TargetsConfig = documented(TargetsConfig(), "monitoring targets and stop_when_met")
    oom: OOMConfig = documented(OOMConfig(), "out-of-memory retries")
    on_policy: OnPolicyConfig = documented(OnPolicyConfig(), "on-policy distillation (GKD): fraction (lambda), "
                                           "temperature, prompt_len, max_new_tokens")
    logger: str | None = documented(None, "also log to Weights & Biases (wandb)", flag="--logger",
                                    choices=("wandb",), none_means="JSONL and TensorBoard only")
    wandb_project: str | None = documented(None, "the W&B project", flag="--wandb-project",
                                           none_means="W&B's default")
    run_dir: str | None = documented(None, "JSONL metrics, TensorBoard events and PNG curves")
    eval_every: int | None = documented(None, "steps between held-out evaluations (also at the start and the end)",
                                        flag="--eval-every", kind=int, none_means="the end only; the recipe: a "
                                        "quarter of --steps")
    eval_batches: int = documented(8, "held-out batches per evaluation")
    progress: bool = documented(True, "progress bar")
    plots: bool = documented(True, "PNG curves in run_dir")
    peak_flops: float | None = documented(None, "per-device peak FLOP/s for MFU", none_means="a table of known "
                                          "accelerators")
    halt_after: int | None = documented(None, "stop after this global step as if interrupted (tests, time-sliced "
                                        "jobs)")
    seed: int = documented(0, "data order, new weights, sampling")

    def __post_init__(self):
        stages = tuple(Stage(**s) if isinstance(s, dict) else s for s in self.stages)
        if not stages:
            raise ValueError("DistillConfig needs at least one Stage.")
        object.__setattr__(self, "stages", stages)
        count_or_none = ("a whole number >= 1 or None", COUNT[1])
        _checked("DistillConfig", self, grad_accum=COUNT, eval_batches=COUNT, seed=COUNT0, top_k=count_or_none,
                 eval_every=count_or_none, logit_chunk=count_or_none, logit_block=count_or_none,
                 logit_vocab_slice=count_or_none, jsd_beta=SHARE)
        check_mode(self.top_k_mode)
        if self.logit_impl not in LOGIT_IMPLS:
            raise ValueError(f"logit_impl={self.logit_impl!r}: use {', '.join(map(repr, LOGIT_IMPLS))}.")
        if self.logit_impl == "two_pass":
            self._check_two_pass()
        object.__setattr__(self, "loss_options", terms.checked_options(self))
        if self.logger not in (None, "wandb"):
            raise ValueError(f"logger={self.logger!r}: use 'wandb' or None (JSONL and TensorBoard are always on).")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype={self.compute_dtype!r}: use 'float32' or 'bfloat16'.")
        if self.attention_kernel not in ("auto", "splash", "xla"):
            raise ValueError(f"attention_kernel={self.attention_kernel!r}: use 'auto', 'splash' or 'xla'.")
        if self.remat is not None and self.remat not in REMAT:
            raise ValueError(f"remat={self.remat!r}: use None or one of {', '.join(map(repr, REMAT))}.")
        self._check_mesh()
        if self.top_k is not None and any(s.weights.reverse_kl for s in stages):
            raise ValueError("top_k cannot be combined with a reverse_kl weight (infinite on truncated support).")
        if self.vocab_map is not None:  # a tuple of ints: hashable, equal after a JSON round trip
            object.__setattr__(self, "vocab_map", tuple(int(i) for i in checked_vocab_map(self.vocab_map)))
        if isinstance(self.on_policy, dict):
            object.__setattr__(self, "on_policy", _build(OnPolicyConfig, self.on_policy, "on_policy"))
        if self.on_policy.fraction and self.seq_len is not None:
            self.on_policy.shape(self.seq_len)

    def _check_two_pass(self) -> None:
        """logit_impl="two_pass" (distill.losses.two_pass) trains forward KL and CE only."""
        asked = [name for name, on in (("top_k", self.top_k is not None), ("teacher_cache", self.teacher_cache),
                                       ("train_diagnostics", self.train_diagnostics),
                                       ("reverse_kl", any(s.weights.reverse_kl for s in self.stages)),
                                       ("jsd", any(s.weights.jsd for s in self.stages))) if on]
        if asked:
            raise ValueError(f"logit_impl='two_pass' computes forward KL and CE only, not {', '.join(asked)}; "
                             "use logit_impl='fused' for those.")

    def _check_mesh(self) -> None:
        """Mesh spec and batch checked when the config is made, not after the models are loaded (MeshError)."""

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
        return sum(stage.length for stage in self.stages)

    def stage_at(self, step: int) -> tuple[int, int]:
        """(stage index, step within the stage) of global step `step` (0-based)."""
        for index, stage in enumerate(self.stages):
            if step < stage.length:
                return index, step
            step -= stage.length
        return len(self.stages) - 1, self.stages[-1].length

    @property
    def unit_temperature(self) -> bool:
        return all(s.temperature.start == 1.0 and s.temperature.end == 1.0 for s in self.stages)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DistillConfig":
        """The config from JSON-like data (what `to_dict` writes, or any subset of it); unknown keys, at any
        level, are a ValueError naming them."""
        data = moved_options(dict(data))
        for key, kind in NESTED.items():
            if isinstance(data.get(key), dict):
                data[key] = _build(kind, data[key], key)
        if isinstance(data.get("correspondence"), dict):
            data["correspondence"] = _build(Correspondence, data["correspondence"], "correspondence")
        _check_keys(cls, data, "DistillConfig")
        data["stages"] = tuple(_build(Stage, s, f"stages[{i}]") if isinstance(s, dict) else s
                               for i, s in enumerate(data.get("stages", cls.stages)))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON data that `from_dict` reads back to an equal config. A jax Mesh is written as its
        axis sizes, a plan as the fields the layer map reads; an NNX filter in a stage (not a pattern) cannot be
        written and is a ValueError."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "stages":
                value = [_stage_dict(stage) for stage in value]
            elif field.name in NESTED or field.name == "correspondence" and value is not None:
                value = _json(dataclasses.asdict(value))
            elif field.name == "plan" and value is not None:
                kept_vocab = _field_of(value, "kept_vocab")  # only plans that trim the vocabulary have it
                value = _json({**{k: _field_of(value, k) for k in ("kept_layers", "kept_hidden", "kept_heads")},
                               **({"kept_vocab": kept_vocab} if kept_vocab is not None else {})})
            elif field.name == "loss_options" and not value:
                continue  # written only when set, so configs from before it existed read back equal
            elif field.name == "mesh" and value is not None and not isinstance(value, (str, dict)):
                value = {str(axis): int(size) for axis, size in dict(value.shape).items()}
            out[field.name] = _json(value)
        return out


# where configs written before the loss terms' options lived only in `loss_options` held two of them
MOVED_OPTIONS = {"feature_kind": ("feature", "kind"), "mse_on": ("mse", "on")}


def moved_options(data: dict[str, Any]) -> dict[str, Any]:
    """`feature_kind` and `guard.mse_on` of an older config as loss_options["feature"]["kind"] and
    loss_options["mse"]["on"] where they are not the default (an explicit loss_options entry wins, as it did)."""
    moved = {"feature_kind": data.pop("feature_kind", None)}
    if isinstance(data.get("guard"), dict) and "mse_on" in data["guard"]:
        data["guard"] = dict(data["guard"])
        moved["mse_on"] = data["guard"].pop("mse_on")
    options = {term: dict(given) for term, given in (data.get("loss_options") or {}).items()}
    for key, value in moved.items():
        term, option = MOVED_OPTIONS[key]
        default = next(o.default for o in terms.term(term).options if o.name == option)
        if value is not None and value != default:  # the default needs no entry
            options.setdefault(term, {}).setdefault(option, value)
    if options:
        data["loss_options"] = options
    return data


NESTED = {"optimizer": OptimizerConfig, "checkpoint": CheckpointConfig, "guard": GuardConfig,
          "targets": TargetsConfig, "oom": OOMConfig, "on_policy": OnPolicyConfig}


def _check_keys(kind: type, data: dict[str, Any], where: str) -> None:
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(kind)})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(kind))
        raise ValueError(f"{where}: unknown keys {unknown}; {kind.__name__} takes {known}.")


def _build(kind: type, data: dict[str, Any], where: str) -> Any:
    _check_keys(kind, data, where)
    return kind(**data)


def _field_of(plan: Any, name: str) -> Any:
    return plan.get(name) if isinstance(plan, dict) else getattr(plan, name, None)


def _stage_dict(stage: Stage) -> dict[str, Any]:
    out = {field.name: getattr(stage, field.name) for field in dataclasses.fields(stage)}
    out.update(weights=stage.weights.to_dict(), temperature=_plain(stage.temperature))
    for key in ("trainable", "frozen"):
        value = out[key]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            out[key] = list(value)
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"{stage.label}: {key}={value!r} is an NNX filter, which a config file "
                             "cannot hold; use path patterns (e.g. 'layers.{0-5}.*') to save the config.")
    return out


def _json(value: Any) -> Any:
    """Tuples as lists, recursively (what JSON gives back)."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


__all__ = ["DistillConfig", "Stage", "LossWeights", "Ramp", "OptimizerConfig", "CheckpointConfig", "GuardConfig",
           "TargetsConfig", "OOMConfig", "OnPolicyConfig", "moved_options", "GUARD_POLICIES", "OOM_STEPS", "OOM_CHOICES", "REMAT"]
