"""Which student parameters train: path patterns or NNX filters, the trainable/frozen split, optimizer-state carry.

Paths are the '.'-joined NNX paths of parameters, e.g. `layers.3.self_attn.k_proj.weight`, `embed_tokens`.
A pattern is a shell glob over that string (`*` also crosses dots) with brace alternatives, and it matches a path
when it matches the whole path or a prefix of whole segments:

    layers.{0-9}.*     layers 0..9 (ranges are inclusive)      layers.{0,5,7}   layers 0, 5 and 7
    embed_tokens       the embedding (and tied LM head)        *.mlp.*          every MLP parameter
    *norm*             every norm scale                        layers.3         everything in layer 3

Anything else accepted by `nnx.filterlib` (a Variable type, `nnx.PathContains(...)`, a `(path, value) -> bool`
callable, `nnx.All/Any/Not`) works as well. Only `nnx.Param` variables are ever trainable. A pattern matching no
parameter is an error (it is almost always a typo), and the error lists close matches.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib

Filter = Any  # patterns (str or list of str), an nnx filter, or None
_BRACE = re.compile(r"\{([^{}]*)\}")


MAX_EXPANSION = 100_000  # patterns one brace pattern may expand to (a model has far fewer parameter paths)


def expand_braces(pattern: str) -> list[str]:
    """`layers.{0-2}.mlp` -> [`layers.0.mlp`, `layers.1.mlp`, `layers.2.mlp`]; `{a,b}` gives alternatives. More
    than MAX_EXPANSION results (e.g. `{0-99999999}`) is a ValueError naming the pattern, raised before any is
    built."""
    return list(_expand(pattern))


def _span(pattern: str, body: str) -> tuple[int, int] | None:
    span = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", body)
    if span is None:
        return None
    low, high = int(span.group(1)), int(span.group(2))
    if low > high:
        raise ValueError(f"pattern {pattern!r}: range {{{body}}} runs backwards; write {{{high}-{low}}}.")
    return low, high


@functools.lru_cache(maxsize=256)
def _expand(pattern: str) -> tuple[str, ...]:
    """One brace group (the innermost first) of every pattern per round, the order of the groups kept; the
    running count is checked before anything bigger than MAX_EXPANSION is built."""
    patterns = [pattern]
    while any(_BRACE.search(p) for p in patterns):
        expanded: list[str] = []
        for current in patterns:
            match = _BRACE.search(current)
            if match is None:
                expanded.append(current)
                continue
            body = match.group(1)
            span = _span(pattern, body)
            count = span[1] - span[0] + 1 if span else body.count(",") + 1
            if len(expanded) + count > MAX_EXPANSION:
                raise ValueError(f"pattern {pattern!r} expands to more than {MAX_EXPANSION:,} paths; use a narrower "
                                 "range or a `*` glob (e.g. layers.*).")
            options = [str(i) for i in range(span[0], span[1] + 1)] if span else [o.strip() for o in body.split(",")]
            expanded += [current[:match.start()] + option + current[match.end():] for option in options]
        patterns = expanded
    return tuple(patterns)


def path_string(path: Sequence[Any]) -> str:
    return ".".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def pattern_matches(pattern: str, path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*") for p in _expand(pattern))


def _as_patterns(spec: Any) -> list[str] | None:
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(p, str) for p in spec):
        return list(spec)
    return None


def to_predicate(spec: Filter, *, default: bool) -> Callable[[tuple, Any], bool]:
    """A `(path, value) -> bool` predicate from patterns or an NNX filter; None means `default` for everything."""
    if spec is None or (isinstance(spec, (list, tuple)) and not spec):
        return lambda path, value: default
    patterns = _as_patterns(spec)
    if patterns is not None:
        return lambda path, value: any(pattern_matches(p, path_string(path)) for p in patterns)
    return filterlib.to_predicate(spec)


def trainable_filter(trainable: Filter = None, frozen: Filter = None) -> Callable[[tuple, Any], bool]:
    """Params selected by `trainable` (all when None) and not selected by `frozen`."""
    keep, drop = to_predicate(trainable, default=True), to_predicate(frozen, default=False)
    return lambda path, value: isinstance(value, nnx.Param) and keep(path, value) and not drop(path, value)


def parameter_paths(model: nnx.Module) -> list[str]:
    return [path_string(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def check_patterns(model: nnx.Module, *specs: Filter) -> None:
    """Raise for a pattern that selects no parameter, suggesting the closest real paths."""
    paths = parameter_paths(model)
    for spec in specs:
        for pattern in _as_patterns(spec) or []:
            if not any(pattern_matches(pattern, path) for path in paths):
                prefixes = sorted({".".join(p.split(".")[:k]) for p in paths for k in range(1, 4)})
                close = difflib.get_close_matches(pattern, prefixes, n=4, cutoff=0.4)
                raise ValueError(f"freeze pattern {pattern!r} matches no parameter of the student"
                                 + (f"; did you mean {close}?" if close else f"; paths look like {paths[:3]}."))


def split_trainable(model: nnx.Module, trainable: Filter = None, frozen: Filter = None):
    """(graphdef, trainable_state, rest_state): the functional split used by the train step."""
    check_patterns(model, trainable, frozen)
    predicate = trainable_filter(trainable, frozen)
    graphdef, train_state, rest = nnx.split(model, predicate, ...)
    if not jax.tree.leaves(train_state):
        raise ValueError(f"no trainable parameter left (trainable={trainable!r}, frozen={frozen!r}); loosen the "
                         "patterns so that at least one nnx.Param is selected.")
    return graphdef, train_state, rest


def master_dtype(dtype) -> Any:
    """float32 for a floating dtype narrower than it (bfloat16, float16), else `dtype`: the dtype of the master
    copy the step updates, whatever the compute dtype. Adam's steps at small learning rates are below bfloat16's
    resolution (8 bits of mantissa) and would round away, and the step would recompile after its first call (its
    float32 moments no longer match)."""
    narrow = jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4
    return jnp.dtype(jnp.float32) if narrow else dtype


def master_weights(tree: Any) -> Any:
    """`tree`'s abstract leaves (ShapeDtypeStruct, their shardings kept) in their `master_dtype`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, master_dtype(x.dtype), sharding=x.sharding), tree)


def cast_back(model: nnx.Module, dtypes: Any) -> None:
    """Cast the model's parameters, in place, to `dtypes` (the tree of their dtypes before training)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x, dtype: x.astype(dtype), state, dtypes))


def count_parameters(state: Any) -> int:
    return int(sum(leaf.size for leaf in jax.tree.leaves(state)))


def describe_split(train_state: Any, rest_state: Any) -> dict[str, int]:
    return {"trainable": count_parameters(train_state),
            "frozen": count_parameters(nnx.state(rest_state, nnx.Param) if isinstance(rest_state, nnx.State)
                                       else rest_state)}


def carry_matching(new_tree: Any, old_tree: Any) -> tuple[Any, int]:
    """Leaves of `new_tree` replaced by the leaf of `old_tree` at the same key path when shape and dtype agree.

    Used at stage switches: Adam moments of parameters that stay trainable (and the step counter) continue;
    parameters that become trainable start from fresh moments. Returns the tree and how many leaves were carried.
    """
    old = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(old_tree)[0]}
    carried = 0

    def pick(path, leaf):
        nonlocal carried
        previous = old.get(jax.tree_util.keystr(path))
        if previous is not None and getattr(previous, "shape", None) == getattr(leaf, "shape", None) \
                and getattr(previous, "dtype", None) == getattr(leaf, "dtype", None):
            carried += 1
            return previous
        return leaf

    return jax.tree_util.tree_map_with_path(pick, new_tree), carried


def selected_paths(model: nnx.Module, trainable: Filter = None, frozen: Filter = None) -> list[str]:
    _, train_state, _ = split_trainable(model, trainable, frozen)
    return [path_string(path) for path, _ in nnx.to_flat_state(train_state)]


__all__ = ["expand_braces", "pattern_matches", "path_string", "to_predicate", "trainable_filter", "split_trainable",
           "check_patterns", "carry_matching", "describe_split", "count_parameters", "selected_paths",
           "parameter_paths"]
