"""The registry of loss terms: which losses a `LossWeights` can weight and the step can compute.

Each registered `LossTerm` (term_types.py) brings its weight names, its options and its fallback role; from the
registry follow the keywords `LossWeights` accepts, the step's traced hyperparameters (`hyper_keys`), the step's
static switches (which terms a stage computes, `StepSettings.terms`, and their options), the options a
`DistillConfig.loss_options` may set, what a run must prepare (a layer map, learned projections, a teacher), the
weights a guard fallback moves, and the recipe's weight flags. The built-in terms are registered at the end of
this module, in the order the step adds them; the logit term (logit_term.py) comes first and owns the weights
kl / reverse_kl / jsd / ce.

A new loss is one module defining its `LossTerm` and one `register` call: below for a built-in term, or
`distill.losses.term_registry.register(MY_TERM)` from user code before the config is built.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from .cosine import COSINE
from .logit_term import LOGIT
from .term_types import LossTerm
from .representations import ATTENTION, FEATURE
from .mse import MSE

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


def active_terms(weights: Mapping[str, float], standby: Iterable[str] = ()) -> tuple[LossTerm, ...]:
    """The registered terms that `weights` turns on, or that own a weight in `standby` (a fallback moves it)."""
    standby = set(standby)
    return tuple(t for t in _REGISTRY.values() if t.active(weights) or standby & set(t.weights))


def fallback_weights(policies: Iterable[str]) -> tuple[str, ...]:
    """The weights the guard fallbacks `policies` move (`LossTerm.fallbacks`): the step compiles them in."""
    policies = tuple(policies)
    return tuple(name for t in _REGISTRY.values() for policy in policies for name in t.fallbacks.get(policy, ()))


def compiled_weights(weights: Mapping[str, float], policies: Iterable[str]) -> dict[str, float]:
    """`weights` with those the fallbacks `policies` move counted as on (1.0 where the stage gives 0): what
    decides a stage's static switches, so a fallback changes traced values only."""
    standby = set(fallback_weights(policies))
    return {name: weights[name] or float(name in standby) for name in weight_names()}


def option_values(loss_term: LossTerm, config: Any) -> dict[str, Any]:
    """The term's option values in a run: `config.loss_options[name]` where it gives them, else the defaults."""
    return loss_term.option_values(getattr(config, "loss_options", {}).get(loss_term.name, {}))


def checked_options(config: Any) -> dict[str, dict[str, Any]]:
    """`config.loss_options` as plain dicts, after checking every registered term's options in `config`: ValueError naming an unknown term, an unknown option or a value
    outside its choices."""
    loss_options = dict(config.loss_options)
    for name, given in loss_options.items():
        if not isinstance(given, Mapping):
            raise ValueError(f"loss_options[{name!r}] must map option names to values, got {given!r}.")
        term(name).option_values(given)
    return {name: dict(given) for name, given in loss_options.items()}


def run_needs(config: Any, attribute: str) -> bool:
    """Whether a stage of `config` computes a term with `attribute` set ("uses_layer_map", "uses_projections"),
    counting the terms its guard fallbacks may switch on and each term as its options make it."""
    policies = config.guard.policies if config.guard.enabled else ()
    standby = fallback_weights(policies)
    return any(getattr(t.resolved(option_values(t, config)), attribute)
               for stage in config.stages for t in active_terms(stage.weights, standby))


def flagged() -> tuple[LossTerm, ...]:
    """The registered terms with a recipe weight flag (`LossTerm.flag`)."""
    return tuple(t for t in _REGISTRY.values() if t.flag)


def needing_teacher(weights: Mapping[str, float]) -> list[str]:
    """The non-zero weights of `weights` that need a teacher."""
    free = {name for t in _REGISTRY.values() for name in t.teacher_free}
    return [name for name in weight_names() if weights[name] != 0 and name not in free]


for _builtin in (LOGIT, ATTENTION, FEATURE):
    register(_builtin)
register(COSINE)
register(MSE)

__all__ = ["register", "registered", "term", "weight_names", "hyper_keys", "active_terms", "needing_teacher",
           "fallback_weights", "compiled_weights", "option_values", "checked_options", "run_needs",
           "flagged", "LossTerm", "STEP_HYPERPARAMETERS"]
