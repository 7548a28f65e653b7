"""The registry of loss terms: which losses a `LossWeights` can weight and the step can compute.

Each registered `LossTerm` (loss_term.py) brings its weight names; from the registry follow the keywords
`LossWeights` accepts, the step's traced hyperparameters (`hyper_keys`), the step's static switches (which terms
a stage computes, `StepSettings.terms`) and what a run must prepare (a layer map, learned projections, a
teacher). The built-in terms are registered at the end of this module, in the order the step adds them; the
logit term (logit_term.py) comes first and owns the weights kl / reverse_kl / jsd / ce.

A new loss is one module defining its `LossTerm` and one `register` call: below for a built-in term, or
`distill.terms.register(MY_TERM)` from user code before the config is built.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from .cosine_loss import COSINE
from .logit_term import LOGIT
from .loss_term import LossTerm
from .losses import ATTENTION, FEATURE
from .mse_loss import MSE

_REGISTRY: dict[str, LossTerm] = {}
STEP_HYPERPARAMETERS = ("lr", "weight_decay", "temperature")  # traced values that are not loss weights


def register(term: LossTerm) -> LossTerm:
    """Add `term` to the registry (its name and weight names must be new); returns it."""
    if not isinstance(term, LossTerm):
        raise TypeError(f"register() takes a LossTerm, got {type(term).__name__}.")
    taken = set(_REGISTRY) | set(weight_names()) | set(STEP_HYPERPARAMETERS)
    clashes = sorted({term.name, *term.weights} & taken)
    if clashes:
        raise ValueError(f"loss term {term.name!r}: {clashes} already registered or reserved (registered terms: "
                         f"{', '.join(_REGISTRY)}; step hyperparameters: {', '.join(STEP_HYPERPARAMETERS)}); "
                         "choose other names.")
    _REGISTRY[term.name] = term
    return term


def registered() -> tuple[LossTerm, ...]:
    """The registered terms, in the order the step adds them."""
    return tuple(_REGISTRY.values())


def term(name: str) -> LossTerm:
    """The registered term called `name`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no loss term {name!r}; registered terms: {', '.join(_REGISTRY)}.") from None


def weight_names() -> tuple[str, ...]:
    """Every loss-weight name of the registered terms (the keywords of `LossWeights`)."""
    return tuple(name for t in _REGISTRY.values() for name in t.weights)


def hyper_keys() -> tuple[str, ...]:
    """The step's traced hyperparameters: learning rate, weight decay, temperature and every loss weight."""
    return STEP_HYPERPARAMETERS + weight_names()


def active_terms(weights: Mapping[str, float]) -> tuple[LossTerm, ...]:
    """The registered terms that `weights` turns on."""
    return tuple(t for t in _REGISTRY.values() if t.active(weights))


def needing_teacher(weights: Mapping[str, float]) -> list[str]:
    """The non-zero weights of `weights` that need a teacher."""
    free = {name for t in _REGISTRY.values() for name in t.teacher_free}
    return [name for name in weight_names() if weights[name] != 0 and name not in free]


def any_term(stage_weights: Iterable[Mapping[str, float]], attribute: str) -> bool:
    """Whether some stage turns on a term with `attribute` set (e.g. "uses_layer_map", "uses_projections")."""
    return any(getattr(t, attribute) for weights in stage_weights for t in active_terms(weights))


for _builtin in (LOGIT, ATTENTION, FEATURE):
    register(_builtin)
register(COSINE)
register(MSE)

__all__ = ["register", "registered", "term", "weight_names", "hyper_keys", "active_terms", "needing_teacher",
           "any_term", "LossTerm", "STEP_HYPERPARAMETERS"]
