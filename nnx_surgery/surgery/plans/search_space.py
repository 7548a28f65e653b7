"""Which students fit a parameter budget: the shapes a search compares, and the shape a user would have guessed.

    found = candidate_specs(teacher.config, params=0.5)            # half the non-embedding parameters, +-5%
    for c in found: print(c.text, c.non_embedding)                 # "layers=12,hidden=640,mlp=1280,..."
    guess = uniform_spec(teacher.config, params=0.5)              # every axis cut by the same ratio

A candidate varies the axes in `axes` over a grid of the teacher's sizes: depth in whole layers, widths in steps
of 1/`grid` of the teacher's (rounded to `align` where the teacher's size allows it), query heads in whole heads,
KV heads among the counts whole teacher KV groups can form, and the vocabulary in halvings. `max_cut` bounds what
each axis may lose (a search of 50% depth cuts is already wide; deeper cuts are better reached iteratively). Each
shape passes `StudentSpec.check_against` (the teacher family's divisibility rule among its checks), so every
candidate can be planned. Parameter counts come from the family's tensor schema (`ModelConfig.num_parameters`), so
they are the counts of the student's checkpoint.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec, divisors

AXES = ("depth", "hidden", "mlp", "heads", "kv_heads", "vocab")
DEFAULT_AXES = ("depth", "hidden", "mlp", "heads")
# The most each axis may lose, as a fraction of the teacher's size.
DEFAULT_MAX_CUT = {"depth": 0.5, "hidden": 0.5, "mlp": 0.75, "heads": 0.5, "kv_heads": 0.5, "vocab": 0.9375}
COUNTINGS = ("non_embedding", "total")
_COUNT_INDEX = {"total": 0, "non_embedding": 1}  # where each counting is in `parameter_counts`' answer


@dataclasses.dataclass(frozen=True)
class ShapeCandidate:
    """One student shape and its parameter counts (the whole checkpoint, and without the embedding and head)."""

    spec: StudentSpec
    parameters: int
    non_embedding: int

    @property
    def text(self) -> str:
        """The `StudentSpec.from_text` form, e.g. "layers=12,hidden=640,mlp=1280,heads=4,kv_heads=1"."""
        s = self.spec
        parts = [f"layers={s.num_layers}", f"hidden={s.hidden_size}", f"mlp={s.intermediate_size}",
                 f"heads={s.num_attention_heads}", f"kv_heads={s.num_key_value_heads}"]
        return ",".join(parts + ([f"vocab={s.vocab_size}"] if s.vocab_size is not None else []))

    def to_dict(self) -> dict:
        return {"student": self.text, "parameters": self.parameters, "non_embedding": self.non_embedding}


def parameter_counts(teacher: ModelConfig, spec: StudentSpec, cache: dict | None = None) -> tuple[int, int]:
    """(total, non-embedding) parameters of the student `spec` cut from `teacher`; `cache` (a dict kept across
    calls for the same teacher) saves recounting shapes that differ only in depth."""
    vocab = spec.vocab_size_for(teacher) or teacher.vocab_size
    widths = (spec.hidden_size, spec.intermediate_size, spec.num_attention_heads, spec.num_key_value_heads, vocab)
    cache = {} if cache is None else cache
    if widths not in cache:
        cache[widths] = _layer_split(teacher, *widths)
    base, per_layer = cache[widths]
    total = base + per_layer * spec.num_layers
    return total, total - vocab * spec.hidden_size * (1 if teacher.tie_word_embeddings else 2)


def _layer_split(teacher: ModelConfig, hidden: int, inter: int, heads: int, kv: int, vocab: int) -> tuple[int, int]:
    """(parameters outside the layers, parameters per layer): counts are linear in depth, so two configs give
    them, and a search over depth costs no more than one over the widths."""
    def count(layers: int) -> int:
        return teacher.replace(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                               num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                               layer_types=tuple(teacher.layer_types[:layers])).num_parameters()
    one, two = count(1), count(2)
    return one - (two - one), two - one


def parse_budget(text: str | int | float) -> int | float:
    """"0.5" (a fraction of the teacher's count), "120M" / "1.5B" / "800k" or a whole count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", str(text))
    if not match:
        raise SpecError(f"parameter budget {text!r}: give a fraction of the teacher's (e.g. 0.5) or a count "
                        "(e.g. 120M, 1.5B, 800k).")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit:
        return int(number * {"k": 1e3, "m": 1e6, "b": 1e9}[unit])
    if "." in match.group(1) or number < 1:  # a fraction of the teacher's count
        if number > 1:
            raise SpecError(f"parameter budget {text!r}: a fraction of the teacher's count is at most 1; for a "
                            f"count give it with a unit (e.g. {number:g}M) or as a whole number.")
        return number
    return int(number) if number > 1 else number


def budget_target(teacher: ModelConfig, params: int | float | str, counting: str) -> int:
    """The budget as a parameter count, checked against the teacher's."""
    if counting not in COUNTINGS:
        raise SpecError(f"counting={counting!r}; choose one of {COUNTINGS}.")
    full = parameter_counts(teacher, StudentSpec(*(getattr(teacher, n) for n in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"))))
    teacher_count = full[_COUNT_INDEX[counting]]
    value = parse_budget(params)
    target = round(teacher_count * value) if isinstance(value, float) else value
    if not 0 < target < teacher_count:
        raise SpecError(f"a budget of {target:,} {counting.replace('_', '-')} parameters is not below the teacher's "
                        f"{teacher_count:,}; give a fraction in (0, 1) or a smaller count.")
    return target


def candidate_specs(teacher: ModelConfig, *, params: int | float | str, counting: str = "non_embedding",
                    tolerance: float = 0.05, axes=DEFAULT_AXES, max_cut: dict | None = None, grid: int = 8,
                    align: int = 64) -> list[ShapeCandidate]:
    """Every valid student shape whose `counting` parameters are within `tolerance` of the budget, largest first.

    `params` is a fraction of the teacher's count or a count ("120M"); `axes` the sizes that may change (others
    stay the teacher's); `max_cut` overrides what an axis may lose (DEFAULT_MAX_CUT)."""
    unknown = set(axes) - set(AXES)
    if unknown:
        raise SpecError(f"unknown search axes {sorted(unknown)}; choose from {AXES}.")
    if not 0 < tolerance < 1:
        raise SpecError(f"tolerance={tolerance}: give the allowed relative distance to the budget, e.g. 0.05.")
    cuts = {**DEFAULT_MAX_CUT, **(max_cut or {})}
    bad = {a: c for a, c in cuts.items() if a not in AXES or not 0 <= c < 1}
    if bad:
        raise SpecError(f"max_cut {bad}: each axis of {AXES} may lose a fraction in [0, 1).")
    target = budget_target(teacher, params, counting)
    found: dict[tuple, ShapeCandidate] = {}
    cache: dict = {}
    for sizes in itertools.product(*_axis_values(teacher, axes, cuts, grid, align)):
        try:
            spec = _spec_of(sizes)
            spec.check_against(teacher)
        except SpecError:
            continue
        total, non_embedding = parameter_counts(teacher, spec, cache)
        count = total if counting == "total" else non_embedding
        if abs(count - target) <= tolerance * target:
            found[sizes] = ShapeCandidate(spec, total, non_embedding)
    if not found:
        raise SpecError(
            f"no student shape over the axes {tuple(axes)} has {target:,} {counting.replace('_', '-')} parameters "
            f"within {tolerance:.0%}: widen the tolerance, add axes, or allow larger cuts (max_cut; now "
            f"{ {a: cuts[a] for a in axes} }).")
    return sorted(found.values(), key=lambda c: (-c.non_embedding, -c.parameters, c.text))


def uniform_spec(teacher: ModelConfig, *, params: int | float | str, counting: str = "non_embedding",
                 axes=DEFAULT_AXES) -> ShapeCandidate:
    """The shape a user would guess: every axis in `axes` scaled by the same ratio, the ratio chosen (by bisection)
    so that the count is as close to the budget as `StudentSpec.scaled` allows."""
    target = budget_target(teacher, params, counting)
    index = _COUNT_INDEX[counting]

    def at(ratio: float) -> StudentSpec:
        scale = {a: (ratio if a in axes else 1.0) for a in ("depth", "hidden", "mlp", "heads", "kv_heads")}
        spec = StudentSpec.scaled(teacher, depth=scale["depth"], hidden=scale["hidden"],
                                  intermediate=scale["mlp"], heads=scale["heads"], kv_heads=scale["kv_heads"])
        if "vocab" in axes:
            spec = dataclasses.replace(spec, vocab_size=max(1, round(teacher.vocab_size * ratio)))
        return spec

    low, high = 1e-3, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if parameter_counts(teacher, at(middle))[index] < target else (low, middle)
    best = min((at(low), at(high)), key=lambda s: abs(parameter_counts(teacher, s)[index] - target))
    return ShapeCandidate(best, *parameter_counts(teacher, best))


def _spec_of(sizes: tuple) -> StudentSpec:
    return StudentSpec(*sizes[:5], vocab_size=sizes[5])


def _axis_values(teacher: ModelConfig, axes, cuts: dict, grid: int, align: int) -> list[list]:
    """Per size (layers, hidden, mlp, heads, KV heads, vocab): the values searched, or the teacher's alone."""
    layers, hidden, inter = teacher.num_hidden_layers, teacher.hidden_size, teacher.intermediate_size
    heads, kv = teacher.num_attention_heads, teacher.num_key_value_heads

    def widths(size: int, axis: str) -> list[int]:
        step = align if size % align == 0 and size // align >= grid else 1
        values = {max(step, step * round(size * i / grid / step)) for i in range(1, grid + 1)}
        return sorted(v for v in values if v >= size * (1 - cuts[axis]) - 1e-9) or [size]

    def counts(size: int, axis: str) -> list[int]:
        return [n for n in range(1, size + 1) if n >= size * (1 - cuts[axis]) - 1e-9]

    return [counts(layers, "depth") if "depth" in axes else [layers],
            widths(hidden, "hidden") if "hidden" in axes else [hidden],
            widths(inter, "mlp") if "mlp" in axes else [inter],
            counts(heads, "heads") if "heads" in axes else [heads],
            [d for d in divisors(kv) if d >= kv * (1 - cuts["kv_heads"]) - 1e-9] if "kv_heads" in axes else [kv],
            _vocab_values(teacher, cuts["vocab"]) if "vocab" in axes else [None]]


def _vocab_values(teacher: ModelConfig, max_cut: float) -> list[int | None]:
    """The teacher's vocabulary (None) and its halvings, down to what `max_cut` allows."""
    values: list[int | None] = [None]
    size = teacher.vocab_size // 2
    while size >= teacher.vocab_size * (1 - max_cut) - 1e-9 and size > 0:
        values.append(size)
        size //= 2
    return values

