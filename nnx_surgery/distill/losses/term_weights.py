"""Loss weights keyed by term name, and ramps (a value moving over a stage: temperature, loss weights)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterator, Mapping, Sequence

from . import term_registry as terms

class LossWeights(Mapping[str, float]):
    """Weights of the loss terms, keyed by the registered weight names (`distill.losses.term_registry`); 0 turns a term off and
    removes its computation from the step.

        LossWeights(kl=0.5, ce=0.5, feature=1.0)      LossWeights({"kl": 1.0, "cosine": 0.1})

    Built in: kl / reverse_kl / jsd (logit divergences, multiplied by temperature^2) and ce (hard-label
    cross-entropy), the kinds of the logit term; attention (attention-map transfer); feature (layer-output
    matching, representations.py); and any registered term. `kl` is 1 unless given; every other weight is 0 unless given.
    Iterating gives every registered weight name; `weights.kl` reads a weight too.

    A weight may ramp over its stage, as temperature does: `LossWeights(kl=[0.0, 0.5], ce=[1.0, 0.5])` starts as
    pure cross-entropy and mixes KL in (SFT, then distil); a `Ramp` or `[start, end, "cosine"]` works too.
    A ramped weight reads as its larger end (`weights.kl == 0.5`: the step computes the term for the whole
    stage); `at(fraction)` gives the values at a point of the stage, traced into the step (no recompilation)."""

    _values: dict[str, float]  # set once in __init__ (the instance is immutable)
    _ramps: dict[str, Ramp]

    def __init__(self, weights: Mapping[str, WeightValue] | None = None, /, **named: WeightValue):
        given = {**dict(weights or {}), **named}
        known = terms.weight_names()
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"LossWeights: unknown loss weight(s) {unknown}; registered: {', '.join(known)} "
                             "(a new loss is registered with distill.losses.term_registry.register).")
        values, ramps = {}, {}
        for name, value in {"kl": 1.0, **given}.items():
            if isinstance(value, (Ramp, list, tuple, dict)):
                ramp = _ramp(value, f"LossWeights: {name}")
                if ramp.start != ramp.end:
                    ramps[name] = ramp
                value = max(ramp.start, ramp.end, key=abs)  # the term is computed while any end is non-zero
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"LossWeights: {name}={value!r} must be a finite number or a [start, end] ramp.")
            values[name] = float(value)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_ramps", ramps)

    @classmethod
    def mixed(cls, alpha: float, divergence: str = "kl", **others: WeightValue) -> "LossWeights":
        """The usual alpha mixing: alpha * divergence + (1 - alpha) * CE."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must lie in [0, 1].")
        return cls({"kl": 0.0, divergence: alpha, "ce": 1.0 - alpha, **others})

    def __getitem__(self, name: str) -> float:
        if name in self._values:
            return self._values[name]
        if name in terms.weight_names():
            return 0.0
        raise KeyError(f"no loss weight {name!r}; registered: {', '.join(terms.weight_names())}.")

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys((*terms.weight_names(), *self._values)))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __getattr__(self, name: str) -> float:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(str(error)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"LossWeights is immutable; build a new one (cannot set {name}).")

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.active_items().items())), tuple(sorted(self._ramps.items()))))

    def __eq__(self, other: Any) -> bool:
        """Equal to another mapping with the same weights (missing names count as 0) and the same ramps."""
        if not isinstance(other, Mapping):
            return NotImplemented
        if self._ramps != (other.ramps if isinstance(other, LossWeights) else {}):
            return False
        return set(other) <= set(self) and all(self[name] == other.get(name, 0.0) for name in self)

    def __repr__(self) -> str:
        inside = ", ".join(f"{name}={_plain(self._ramps.get(name, value))!r}"
                           for name, value in self.active_items().items())
        return f"LossWeights({inside})"

    def __reduce__(self):
        return (type(self), (self.to_dict(),))

    @property
    def ramps(self) -> dict[str, "Ramp"]:
        """The weights that move within the stage."""
        return dict(self._ramps)

    def at(self, fraction: float) -> dict[str, float]:
        """Every registered weight at `fraction` of the stage (0: its first step, 1: its last)."""
        return {name: self._ramps[name].at(fraction) if name in self._ramps else value
                for name, value in self.items()}

    def to_dict(self) -> dict[str, Any]:
        """The weights as given (numbers; ramps as [start, end] or [start, end, shape]): JSON, and
        `LossWeights(weights.to_dict()) == weights`."""
        return {name: _plain(self._ramps.get(name, value)) for name, value in self._values.items()}

    def active_items(self) -> dict[str, float]:
        """The non-zero weights."""
        return {name: value for name, value in self.items() if value != 0.0}

    def as_dict(self) -> dict[str, float]:
        """Every registered weight by name (0 for those not given)."""
        return dict(self.items())

    def active(self) -> frozenset[str]:
        return frozenset(self.active_items())


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


# a loss weight as given: a number, or a ramp (a Ramp, [start, end], [start, end, shape] or {"start", "end", "shape"})
WeightValue = float | Ramp | tuple[Any, ...] | list[Any] | Mapping[str, Any]


def _ramp(value: WeightValue, where: str = "ramp") -> Ramp:
    """A Ramp from a number (constant), [start, end], [start, end, shape] or {"start", "end", "shape"}."""
    if isinstance(value, Ramp):
        ramp = value
    elif isinstance(value, Mapping):
        ramp = Ramp(float(value["start"]), float(value["end"]), value.get("shape", "linear"))
    elif isinstance(value, (tuple, list)):
        if len(value) not in (2, 3):
            raise ValueError(f"{where}: {list(value)!r} must be [start, end] or [start, end, shape].")
        ramp = Ramp(float(value[0]), float(value[1]), *(value[2:]))
    else:
        ramp = Ramp(float(value), float(value))
    if ramp.shape not in ("linear", "cosine") or not (math.isfinite(ramp.start) and math.isfinite(ramp.end)):
        raise ValueError(f"{where}: {ramp} must have finite ends and shape 'linear' or 'cosine'.")
    return ramp


def _plain(value: float | Ramp) -> float | list:
    """A number or Ramp as JSON: the number, [start, end] or [start, end, shape]."""
    if not isinstance(value, Ramp):
        return value
    if value.start == value.end:
        return value.start
    return [value.start, value.end] + ([value.shape] if value.shape != "linear" else [])


__all__ = ["LossWeights", "Ramp"]
