"""Named schedules (stages ready to put in a DistillConfig), and stage lengths in epochs of the data.

    progressive(18, 3000)            three stages: the first 80% of the layers frozen at lr 1e-4, then the first 50%
                                     at 5e-5, then everything at 1e-5; temperature 3 -> 1 over the run; alpha 0.5
    progressive(18, epochs=2.0)      the same, each stage a third of two epochs of the data
    sft_then_distil(1000)            one stage moving from pure cross-entropy to alpha * KL + (1 - alpha) * CE

Stages given in epochs (`Stage(epochs=0.5)`) become steps when the run starts (`resolve_epochs`): an epoch is
every training row of the data once, the data says how many rows it has (`TokenBatches.num_rows`: the documents
packed into rows of seq_len tokens), and an optimizer step takes `batch_size x grad_accum` rows.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from .run_config import DistillConfig, LossWeights, Ramp, Stage
from ..inputs.sources import DataError


def progressive(num_layers: int, total_steps: int | None = None, *, epochs: float | None = None,
                frozen_fractions: Sequence[float] = (0.8, 0.5, 0.0),
                learning_rates: Sequence[float] = (1e-4, 5e-5, 1e-5), shares: Sequence[float] | None = None,
                temperature: float | Sequence[float] = (3.0, 1.0), alpha: float = 0.5, divergence: str = "kl",
                extra_weights: Mapping[str, float] | None = None, extra_frozen: Sequence[str] = (),
                layers_path: str = "layers", warmup_steps: int = 0, min_lr_ratio: float = 1.0) -> tuple[Stage, ...]:
    """Progressive unfreezing: stage i freezes the first `floor(frozen_fractions[i] * num_layers)` decoder layers
    (`layers_path.{0-k}`) and trains the rest at `learning_rates[i]` (held for the stage unless `min_lr_ratio` <
    1, which decays it along a cosine; `warmup_steps` warm up each stage). The lower layers hold the features the
    surgery kept, so they are disturbed last.

    The run is `total_steps` optimizer steps or `epochs` of the data (one of them), split by `shares` (default:
    equal). The loss is `alpha * divergence + (1 - alpha) * CE` (plus `extra_weights`, e.g. {"attention": 0.1});
    `temperature` (start, end) anneals linearly over the whole run, each stage carrying its piece of the line.
    `extra_frozen` patterns (e.g. ["embed_tokens"]) stay frozen in every stage."""
    count = len(frozen_fractions)
    shares = tuple(shares) if shares is not None else (1.0,) * count
    if (total_steps is None) == (epochs is None):
        raise ValueError("progressive: give the run's length as total_steps or epochs (one of them).")
    if num_layers < 1 or len(learning_rates) != count or len(shares) != count or min(shares) <= 0:
        raise ValueError(f"progressive: num_layers ({num_layers}) must be >= 1, and frozen_fractions, "
                         f"learning_rates and shares need one positive entry per stage ({count}).")
    if any(not 0.0 <= fraction <= 1.0 for fraction in frozen_fractions):
        raise ValueError(f"progressive: frozen_fractions {tuple(frozen_fractions)} must lie in [0, 1].")
    bounds = [sum(shares[:i]) / sum(shares) for i in range(count + 1)]  # run fractions where the stages start
    lengths = _split(total_steps, bounds) if total_steps is not None else [None] * count
    anneal = _ramp_of(temperature)
    weights = LossWeights.mixed(alpha, divergence, **dict(extra_weights or {}))
    stages = []
    for i in range(count):
        frozen_layers = math.floor(frozen_fractions[i] * num_layers)
        frozen = ([f"{layers_path}.{{0-{frozen_layers - 1}}}"] if frozen_layers else []) + list(extra_frozen)
        start, end = _stage_span(bounds, i, lengths, total_steps)
        stages.append(Stage(
            steps=lengths[i], epochs=None if epochs is None else epochs * (bounds[i + 1] - bounds[i]),
            frozen=frozen or None, learning_rate=learning_rates[i], warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio, weights=weights, temperature=(anneal.at(start), anneal.at(end)),
            name=f"progressive {i + 1}/{count}: first {frozen_layers} of {num_layers} layers frozen"))
    return tuple(stages)


def sft_then_distil(total_steps: int | None = None, *, epochs: float | None = None, alpha: float = 0.5,
                    divergence: str = "kl", learning_rate: float = 1e-4, temperature: float | Sequence[float] = 1.0,
                    warmup_steps: int = 0, **stage_fields: Any) -> Stage:
    """One stage whose loss moves linearly from pure hard-label cross-entropy to `alpha * divergence +
    (1 - alpha) * CE`: the student first fits the data, then the teacher's distribution takes over."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"sft_then_distil: alpha={alpha} must lie in [0, 1].")
    weights = LossWeights({"kl": 0.0, divergence: [0.0, alpha], "ce": [1.0, 1.0 - alpha]})
    return Stage(steps=total_steps, epochs=epochs, learning_rate=learning_rate, warmup_steps=warmup_steps,
                 weights=weights, temperature=temperature, name="SFT, then distil", **stage_fields)


def steps_per_epoch(data: Any, config: DistillConfig) -> float:
    """Optimizer steps in one pass over the training rows of `data`: rows per epoch / (rows per micro-batch x
    grad_accum). The data says its size (`num_rows`, as TokenBatches does) and its batch size (`batch_size`, else
    the config's)."""
    rows = getattr(data, "num_rows", None)
    batch = getattr(data, "batch_size", None) or config.batch_size
    if not isinstance(rows, int) or rows < 1 or not batch:
        raise DataError(f"a stage is given in epochs, but the data ({type(data).__name__}) does not say how many rows "
                        "an epoch has (a `num_rows` attribute, as TokenBatches has) or its batch size; give the "
                        "stage in steps instead.")
    return rows / (batch * config.grad_accum)


def resolve_epochs(config: DistillConfig, data: Any) -> DistillConfig:
    """`config` with every stage given in epochs resolved to steps for `data` (round to nearest, at least 1);
    the stage keeps its `epochs`, so a saved config re-resolves the same way on the same data. Stages in steps
    are left alone; a config without epochs comes back unchanged (the data is then not asked)."""
    if all(stage.epochs is None for stage in config.stages):
        return config
    per_epoch = steps_per_epoch(data, config)
    stages = tuple(stage if stage.epochs is None else
                   dataclasses.replace(stage, steps=max(1, round(stage.epochs * per_epoch)))
                   for stage in config.stages)
    return dataclasses.replace(config, stages=stages)


def _split(total_steps: int, bounds: Sequence[float]) -> list[int]:
    """Whole stage lengths adding up to total_steps, each at least 1, the cuts at the rounded run fractions."""
    if total_steps < len(bounds) - 1:
        raise ValueError(f"progressive: total_steps={total_steps} cannot give {len(bounds) - 1} stages a step each.")
    cuts = [round(total_steps * b) for b in bounds]
    for i in range(1, len(cuts) - 1):
        cuts[i] = min(max(cuts[i], cuts[i - 1] + 1), total_steps - (len(cuts) - 1 - i))
    return [cuts[i + 1] - cuts[i] for i in range(len(cuts) - 1)]


def _stage_span(bounds, index, lengths, total_steps) -> tuple[float, float]:
    """Run fractions of a stage's first and last step (exact in steps; the share bounds in epochs)."""
    if total_steps is None or total_steps < 2:
        return bounds[index], bounds[index + 1]
    first = sum(lengths[:index])
    return first / (total_steps - 1), (first + lengths[index] - 1) / (total_steps - 1)


def _ramp_of(value: float | Sequence[float | str]) -> Ramp:
    """A Ramp from a number (constant), (start, end) or (start, end, shape)."""
    if isinstance(value, (int, float)):
        return Ramp(float(value), float(value))
    return Ramp(float(value[0]), float(value[1]), *map(str, value[2:]))


__all__ = ["progressive", "sft_then_distil", "steps_per_epoch", "resolve_epochs"]
