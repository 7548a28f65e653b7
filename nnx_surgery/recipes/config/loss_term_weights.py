"""The loss terms' weights in the recipe's settings (`training.term_weights`), as a declared type. Imports nothing
heavy (the sections, and so `--help`, read it)."""
from __future__ import annotations

import dataclasses
import types
from typing import Iterator, Mapping


@dataclasses.dataclass(frozen=True, eq=False)
class TermWeights(Mapping[str, float]):
    """The loss terms' weights beside the divergence (`training.term_weights`; their flags --<term>-weight, made
    from the terms' registry: distill.losses.term_registry). The built-in terms with a recipe flag are fields;
    a term registered later with a flag (`distill.register_loss`) has its weight in `registered`. Also read as a
    mapping, term name -> weight (0 for a term the settings do not name)."""

    attention: float = 0.0
    feature: float = 0.0
    cosine: float = 0.0
    registered: Mapping[str, float] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    @classmethod
    def of(cls, weights: Mapping[str, float]) -> "TermWeights":
        """`weights` by term name: the built-in terms' as fields, the others in `registered`."""
        if isinstance(weights, TermWeights):
            return weights
        built_in = {name: float(weight) for name, weight in weights.items() if name in BUILT_IN_TERMS}
        others = {name: float(weight) for name, weight in weights.items() if name not in BUILT_IN_TERMS}
        return cls(**built_in, registered=types.MappingProxyType(others))

    def __getitem__(self, name: str) -> float:
        if name in BUILT_IN_TERMS:
            return getattr(self, name)
        return self.registered[name]

    def __iter__(self) -> Iterator[str]:
        yield from BUILT_IN_TERMS
        yield from self.registered

    def __len__(self) -> int:
        return len(BUILT_IN_TERMS) + len(self.registered)


BUILT_IN_TERMS = ("attention", "feature", "cosine")


__all__ = ["TermWeights", "BUILT_IN_TERMS"]
