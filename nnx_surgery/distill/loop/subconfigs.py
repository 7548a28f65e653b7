"""DistillConfig's nested settings: the optimizer, checkpoints, the divergence guard, the monitoring targets and the
out-of-memory retries (plain frozen dataclasses, each checked when made), and the number checks they share."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from ...field_docs import documented


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax.scale_by_adam + decoupled weight decay) with global-norm clipping."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = documented(0.0, "AdamW decoupled weight decay on matrices (0: a short recovery run "
                                     "stays near the pruned weights)", flag="--weight-decay", kind=float)
    clip_norm: float | None = documented(1.0, "clip gradients to this global norm", flag="--clip-norm", kind=float,
                                         none_means="no clipping")
    decay_matrices_only: bool = True  # no decay on norm scales and other vectors

    def __post_init__(self):
        _checked("OptimizerConfig", self, b1=SHARE, b2=SHARE, eps=POSITIVE, clip_norm=("a finite number > 0 or None",
                 POSITIVE[1]), weight_decay=("a finite number >= 0", lambda v: v >= 0))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of student, optimizer state and data position in `directory` every `every` steps."""

    directory: str | None = None
    every: int = documented(100, "optimizer steps between checkpoints (resume loses at most this many)",
                            flag="--checkpoint-every", kind=int)
    keep: int = 2
    resume: bool = True  # continue from the latest checkpoint in `directory` when there is one

    def __post_init__(self):
        _checked("CheckpointConfig", self, every=COUNT, keep=COUNT)


def _names(value, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A name or a sequence of names, as a tuple; ValueError listing `allowed` for any other."""
    names = (value,) if isinstance(value, str) else tuple(value)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ValueError(f"{what} {unknown}; choose from {allowed}.")
    return names


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
    policies: tuple[str, ...] = documented((), "after a divergence, besides rollback and halving the learning "
                                           "rate: switch_to_mse (an auxiliary MSE loss for a while, on what the mse "
                                           "term's option `on` says), sft_then_mix (pure CE, then ramp back to alpha "
                                           "0.5); repeatable", flag="--fallback", action="append",
                                           choices=("switch_to_mse", "sft_then_mix"))
    mse_weight: float = 1.0  # switch_to_mse: weight of the auxiliary MSE term ("mse")
    mse_steps: int = 20  # switch_to_mse: optimizer steps it stays on after a divergence
    sft_steps: int = 20  # sft_then_mix: steps of pure cross-entropy
    sft_ramp_steps: int = 20  # sft_then_mix: steps to ramp the distillation weight back
    sft_alpha: float = 0.5  # sft_then_mix: the alpha it ramps back to
    sft_patience: int = 1  # sft_then_mix: evaluations worse than the stage's start before falling back

    def __post_init__(self):
        policies = _names(self.policies, GUARD_POLICIES, "GuardConfig: unknown policies")
        object.__setattr__(self, "policies", policies)
        _checked("GuardConfig", self, sft_alpha=SHARE, mse_weight=("a finite number >= 0", lambda v: v >= 0),
                 mse_steps=COUNT0, sft_steps=COUNT0, sft_ramp_steps=COUNT0, sft_patience=COUNT0, window=COUNT,
                 min_history=COUNT0, max_rollbacks=COUNT0, spike_factor=("a finite number > 1", lambda v: v > 1),
                 lr_backoff=("a number in (0, 1]", lambda v: 0 < v <= 1))


def _checked(owner: str, obj, **rules: tuple[str, Any]) -> None:
    """ValueError naming the field unless it is a finite real number (whole for a rule saying so) that the rule's
    test accepts; a field whose rule allows None may be None."""
    for name, (need, fine) in rules.items():
        value = getattr(obj, name)
        if value is None and "or None" in need:
            continue
        number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if not number or ("whole" in need and int(value) != value) or not fine(value):
            raise ValueError(f"{owner}: {name}={value!r} must be {need}.")


COUNT, COUNT0 = ("a whole number >= 1", lambda v: v >= 1), ("a whole number >= 0", lambda v: v >= 0)
SHARE, POSITIVE = ("a number in [0, 1]", lambda v: 0 <= v <= 1), ("a finite number > 0", lambda v: v > 0)
GUARD_POLICIES = ("switch_to_mse", "sft_then_mix")
# remat values: "dots" / "full" checkpoint the whole student forward; "layers" / "layers_dots" each layer
# (distill.loop.train_step.LAYER_REMAT, passed to the student's call)
REMAT = ("dots", "full", "layers", "layers_dots")
LOGIT_IMPLS = ("fused", "fused_xla", "kernel", "two_pass", "reference")  # DistillConfig.logit_impl
OOM_STEPS = ("layers_dots", "layers", "halve_batch")  # the default retry ladder (distill/loop/oom.py says why)
OOM_CHOICES = ("dots", "full", "layers", "layers_dots", "halve_batch")


@dataclasses.dataclass(frozen=True)
class TargetsConfig:
    """Monitoring targets checked at every held-out evaluation; None switches a target off."""

    kl_below: float | None = 0.1  # held-out KL(teacher || student) at T=1
    correlation_above: float | None = 0.95  # teacher-student logit correlation on held-out data
    perplexity_below: float | None = None  # held-out student perplexity
    utilisation_above: float | None = 0.8  # fraction of wall time inside the step (vs data/host waits)
    mfu_above: float | None = None  # model FLOPs utilisation, where the device peak is known
    stop_when_met: bool = documented(False, "end the run at the first evaluation meeting every target (targets.* "
                                     "in --config / --set)", flag="--stop-when-met", action="store_true")
    warn_low_utilisation: bool = True  # warn with the likely cause when utilisation stays under target

    def __post_init__(self):
        for name in ("kl_below", "correlation_above", "perplexity_below", "utilisation_above", "mfu_above"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value)):
                raise ValueError(f"TargetsConfig: {name}={value!r} must be a finite number or None.")


@dataclasses.dataclass(frozen=True)
class OOMConfig:
    """Out-of-memory retries: on RESOURCE_EXHAUSTED while compiling or running the step, try each of `sequence`
    in turn (a remat value: that remat; "halve_batch": half the micro-batch, twice the accumulation)."""

    retry: bool = documented(True, "on out-of-memory, retry with remat layers_dots, remat layers, then half the "
                             "micro-batch and twice the accumulation (--no-oom-retry: fail instead)",
                             flag="--no-oom-retry", action="store_false")
    sequence: tuple[str, ...] = OOM_STEPS

    def __post_init__(self):
        object.__setattr__(self, "sequence", _names(self.sequence, OOM_CHOICES, "OOMConfig: unknown steps"))


__all__ = ["OptimizerConfig", "CheckpointConfig", "GuardConfig", "TargetsConfig", "OOMConfig", "GUARD_POLICIES", "REMAT", "OOM_STEPS", "OOM_CHOICES", "COUNT", "COUNT0", "SHARE", "POSITIVE"]
