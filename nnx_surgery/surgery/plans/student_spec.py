"""What student to derive: `StudentSpec`, named target shapes, and the checks that run before any work.

A spec fixes five sizes and, optionally, the vocabulary's (`vocab_size`: a number of pieces or a fraction of the
teacher's; `surgery.plans.vocab_selection` chooses them); everything else (`head_dim`, `query_pre_attn_scalar`, soft-caps, RoPE,
the family) stays the teacher's, and every surviving layer keeps its attention type. Widths are uniform across
layers because a Hugging Face config has one value per size. `StudentSpec.from_text` reads the
"layers=12,mlp=0.5,vocab=16384" form.

KV heads are the axis pruning tools most often get wrong: a query head only works with the KV head it was trained
with. So a student KV head is formed from *whole* teacher KV groups, in one of two ways:

    select  the student keeps some teacher KV heads as they are and, for each, query heads of that head's group;
            possible when the student has no more query heads per KV head than the teacher (G_s <= G_t).
    merge   the teacher KV heads are split into equal consecutive sets, each averaged into one student KV head
            (GQA paper, mean pooling); its query heads come from any group of the set. Needs K_t % K_s == 0.
            Gemma 7B -> 2B (16 KV heads -> 1, multi-head -> multi-query) can only be done this way.
"""
from __future__ import annotations

import dataclasses
import math

from nnx_surgery.surgery.modeling.model_config import ModelConfig


class SpecError(ValueError):
    """A student spec, or a plan, that cannot be built from this teacher: says which constraint and how to fix it."""


# name: (layers, hidden, intermediate, heads, kv heads, head_dim) of real Gemma checkpoints (their config.json).
NAMED_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "gemma-2b": (18, 2048, 16384, 8, 1, 256),
    "gemma-7b": (28, 3072, 24576, 16, 16, 256),
    "gemma-2-2b": (26, 2304, 9216, 8, 4, 256),
    "gemma-2-9b": (42, 3584, 14336, 16, 8, 256),
    "gemma-3-270m": (18, 640, 2048, 4, 1, 256),
    "gemma-3-1b": (26, 1152, 6912, 4, 1, 256),
    "gemma-3-4b": (34, 2560, 10240, 8, 4, 256),
}
KV_MODES = ("auto", "select", "merge")
SIZE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
TEACHER_FIELDS = dict(zip(SIZE_FIELDS, ("num_hidden_layers", "hidden_size", "intermediate_size",
                                        "num_attention_heads", "num_key_value_heads")))
TEXT_KEYS = {"layers": "num_layers", "hidden": "hidden_size", "mlp": "intermediate_size",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size"}


@dataclasses.dataclass(frozen=True)
class StudentSpec:
    """The student's sizes. `name` is set by `named()`: such a spec must also match that model's head_dim."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    name: str | None = None
    vocab_size: int | float | None = None  # pieces kept, or a fraction of the teacher's; None: all of them

    def __post_init__(self):
        for field in SIZE_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"StudentSpec.{field}={value!r} must be a positive integer.")
        vocab = self.vocab_size
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, (int, float))
                                  or (isinstance(vocab, int) and vocab <= 0)
                                  or (isinstance(vocab, float) and not 0 < vocab <= 1)):
            raise SpecError(f"StudentSpec.vocab_size={vocab!r} must be a number of pieces (a positive integer), a "
                            "fraction of the teacher's vocabulary in (0, 1] (a float), or None to keep it all.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError(
                f"StudentSpec: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; every KV head serves the same number of query "
                f"heads. Use a divisor of {self.num_attention_heads} "
                f"({', '.join(map(str, divisors(self.num_attention_heads)))}) as num_key_value_heads.")

    # ---------------------------------------------------------------------------------------------- builders
    @classmethod
    def named(cls, name: str) -> "StudentSpec":
        """The shape of a released Gemma: one of NAMED_SHAPES (e.g. "gemma-2b", the 7B -> 2B target)."""
        key = name.lower().removeprefix("google/")
        if key not in NAMED_SHAPES:
            raise SpecError(f"no named student shape {name!r}; known: {', '.join(NAMED_SHAPES)}.")
        layers, hidden, inter, heads, kv, _ = NAMED_SHAPES[key]
        return cls(layers, hidden, inter, heads, kv, name=key)

    @classmethod
    def scaled(cls, teacher: ModelConfig, *, depth: float = 1.0, hidden: float = 1.0, intermediate: float = 1.0,
               heads: float = 1.0, kv_heads: float = 1.0) -> "StudentSpec":
        """Each teacher size times a fraction, rounded, then adjusted to the nearest valid shape: KV heads that
        whole teacher groups can form, query heads a multiple of them, hidden a multiple of the heads."""
        layers = _fraction_of(teacher.num_hidden_layers, depth)
        inter = _fraction_of(teacher.intermediate_size, intermediate)
        n_t, k_t = teacher.num_attention_heads, teacher.num_key_value_heads
        kv, n = _fraction_of(k_t, kv_heads), _fraction_of(n_t, heads)
        if -(-n // kv) > teacher.num_query_groups and k_t % kv:  # needs a merge: kv must divide the teacher's
            kv = min(divisors(k_t), key=lambda d: (abs(d - kv), d))
        n = min(kv * max(1, round(n / kv)), n_t - n_t % kv)
        d = _fraction_of(teacher.hidden_size, hidden)
        d = max(n, min(teacher.hidden_size - teacher.hidden_size % n, n * max(1, round(d / n))))
        return cls(layers, d, inter, n, kv)

    @classmethod
    def scaled_like(cls, teacher: ModelConfig, reference_teacher: str = "gemma-7b",
                    reference_student: str = "gemma-2b") -> "StudentSpec":
        """A student that is to `teacher` what `reference_student` is to `reference_teacher` (per-axis ratios):
        with the defaults, a teacher of any family gets Gemma 7B:2B's shape ratios."""
        big, small = cls.named(reference_teacher), cls.named(reference_student)
        ratio = {f: getattr(small, f) / getattr(big, f) for f in SIZE_FIELDS}
        return cls.scaled(teacher, depth=ratio["num_layers"], hidden=ratio["hidden_size"],
                          intermediate=ratio["intermediate_size"], heads=ratio["num_attention_heads"],
                          kv_heads=ratio["num_key_value_heads"])

    @classmethod
    def from_text(cls, text: str | None, teacher: ModelConfig) -> "StudentSpec":
        """"scaled" (`scaled_like`), a named shape, or "key=value,...": layers, hidden, mlp, heads, kv_heads
        (sizes, or fractions in (0, 1) of the teacher's) and vocab (a number of pieces, or a fraction such as
        0.25 or 1.0 when written with a decimal point); what is not given stays the teacher's."""
        text = (text or "").strip()
        if text == "scaled":
            return cls.scaled_like(teacher)
        if "=" not in text:
            return cls.named(text)
        sizes: dict = {field: getattr(teacher, name) for field, name in TEACHER_FIELDS.items()}
        seen: set[str] = set()
        for item in text.split(","):
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in TEXT_KEYS:
                raise SpecError(f"student shape {text!r}: unknown key {key!r}; use {', '.join(TEXT_KEYS)} "
                                "(e.g. layers=12,mlp=1024,vocab=16384).")
            if key in seen:
                raise SpecError(f"student shape {text!r}: {key} is given twice; give each size once.")
            seen.add(key)
            sizes[TEXT_KEYS[key]] = _text_size(key, value, teacher, text)
        return cls(**sizes)

    def vocab_size_for(self, teacher: ModelConfig) -> int | None:
        """The number of pieces the student keeps (a fraction resolved against the teacher), or None (all)."""
        if self.vocab_size is None or isinstance(self.vocab_size, int):
            return self.vocab_size
        return max(1, min(teacher.vocab_size, int(math.floor(teacher.vocab_size * self.vocab_size + 0.5))))

    # ---------------------------------------------------------------------------------------------- checks
    def check_against(self, teacher: ModelConfig, kv_mode: str = "auto") -> str:
        """Raise SpecError naming the first constraint this spec breaks for `teacher`; return the KV formation
        ("select" or "merge") it will use."""
        for field, teacher_field in TEACHER_FIELDS.items():
            mine, theirs = getattr(self, field), getattr(teacher, teacher_field)
            if mine > theirs:
                raise SpecError(f"StudentSpec.{field}={mine} is larger than the teacher's {teacher_field}={theirs}; "
                                f"a student is cut from the teacher, so use at most {theirs}.")
        vocab = self.vocab_size_for(teacher)
        if vocab is not None and vocab > teacher.vocab_size:
            raise SpecError(f"StudentSpec.vocab_size={vocab} is larger than the teacher's vocab_size="
                            f"{teacher.vocab_size}; keep at most {teacher.vocab_size} pieces, or None for all.")
        rule = teacher.family.broken_rule(teacher.model_type, self.hidden_size, self.num_attention_heads)
        if rule:
            lower = self.hidden_size - self.hidden_size % self.num_attention_heads
            raise SpecError(
                f"StudentSpec.hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                f"{self.num_attention_heads}: the {teacher.family.name} family's rule for {teacher.model_type} "
                f"({rule}; transformers rejects such configs although head_dim is explicit). Use hidden_size="
                f"{lower or self.num_attention_heads} or {lower + self.num_attention_heads}.")
        if self.name is not None and NAMED_SHAPES[self.name][5] != teacher.head_dim:
            raise SpecError(f"StudentSpec.named({self.name!r}) has head_dim {NAMED_SHAPES[self.name][5]}, but a "
                            f"student keeps the teacher's head_dim {teacher.head_dim}; the result would not be "
                            f"{self.name}-shaped. Build StudentSpec(...) with explicit sizes instead.")
        return kv_formation(teacher, self, kv_mode)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StudentSpec":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SpecError(f"StudentSpec has no field(s) {sorted(unknown)}.")
        return cls(**data)

    def config_for(self, teacher: ModelConfig, kept_layers: list[int]) -> ModelConfig:
        """The student's config: the teacher's, with these sizes and the kept layers' attention types."""
        return teacher.replace(
            num_hidden_layers=self.num_layers, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            layer_types=tuple(teacher.layer_types[i] for i in kept_layers))


def kv_formation(teacher: ModelConfig, spec: StudentSpec, mode: str = "auto") -> str:
    """"select" or "merge" (see the module docstring), or a SpecError saying why neither works."""
    if mode not in KV_MODES:
        raise SpecError(f"kv_mode={mode!r}; choose one of {KV_MODES}.")
    k_t, k_s = teacher.num_key_value_heads, spec.num_key_value_heads
    g_t, g_s = teacher.num_query_groups, spec.num_attention_heads // k_s
    can_select = g_s <= g_t
    can_merge = k_t % k_s == 0
    if mode == "select" and not can_select:
        raise SpecError(
            f"kv_mode='select' keeps teacher KV heads whole, each with at most its {g_t} query head(s), but the "
            f"spec asks for {g_s} query heads per KV head ({spec.num_attention_heads} heads / {k_s} KV heads). "
            f"Use kv_mode='merge' (needs num_key_value_heads dividing {k_t}) or at most {g_t * k_s} query heads.")
    if mode == "merge" and not can_merge:
        raise SpecError(
            f"kv_mode='merge' averages equal sets of whole teacher KV heads, but {k_t} teacher KV heads do not "
            f"split into {k_s} equal sets. Use num_key_value_heads in ({', '.join(map(str, divisors(k_t)))}).")
    if mode == "auto":
        if can_select:
            return "select"
        if not can_merge:
            raise SpecError(
                f"num_key_value_heads={k_s} cannot be formed from whole teacher KV groups: the teacher has {k_t} KV "
                f"heads with {g_t} query head(s) each, so keeping KV heads allows at most {g_t} query heads per KV "
                f"head (the spec needs {g_s}), and merging needs num_key_value_heads to divide {k_t}. Use "
                f"num_key_value_heads in ({', '.join(map(str, divisors(k_t)))}), or at most {g_t * k_s} "
                "query heads.")
        return "merge"
    return mode


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _text_size(key: str, value: str, teacher: ModelConfig, text: str) -> int | float:
    """One value of `StudentSpec.from_text`: a whole size, or a fraction of the teacher's size."""
    teacher_size = teacher.vocab_size if key == "vocab" else getattr(teacher, TEACHER_FIELDS[TEXT_KEYS[key]])
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if key == "vocab" and any(c in value for c in ".eE") and 0 < number <= 1:
        return number  # a fraction, resolved against the teacher when planned
    if 0 < number < 1 and key != "vocab":
        return max(1, round(teacher_size * number))
    if not math.isfinite(number) or number != int(number) or number < 1:
        raise SpecError(f"student shape {text!r}: {key}={value!r} must be a positive whole size or a fraction of "
                        f"the teacher's {teacher_size} (e.g. {key}={teacher_size // 2} or {key}=0.5).")
    return int(number)


def _fraction_of(size: int, fraction: float) -> int:
    if not 0 < fraction <= 1:
        raise SpecError(f"a scaling fraction must be in (0, 1]; got {fraction}.")
    return max(1, min(size, int(math.floor(size * fraction + 0.5))))
