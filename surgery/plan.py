"""`Plan`: a surgery decision as plain data, written next to every student it produces.

A plan names the teacher (source, revision, full config), the spec, the student's config, and every index the
student keeps, in teacher numbering:

    kept_layers[s]        teacher layer that becomes student layer s (layer_types[s] is its attention type)
    kept_hidden           teacher hidden channels, shared by every tensor that reads or writes the residual
    kept_mlp[s]           teacher MLP neurons of student layer s (gate/up rows and down columns, paired)
    kv_groups[s][j]       teacher KV heads averaged into student KV head j (one entry: kept as is), with
    kv_weights[s][j]      their weights (the merge is sum(w_i * W_i) / sum(w_i), in float32)
    kept_heads[s][j]      teacher query heads attached to student KV head j, each from a group in kv_groups[s][j]
    embed_scale           factor on the kept embedding columns (compensates sqrt(hidden) shrinking)
    norm_scales           factor f on each RMSNorm's (1 + w): (1 + w') = (1 + w) * f, with the tied-head fold

plus the scores and method names that led there. Nothing in a plan refers to arrays: it is JSON all the way down,
so `Plan.from_json(plan.to_json()) == plan`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .config import GemmaConfig
from .spec import StudentSpec

FORMAT, FORMAT_VERSION = "nnx-surgery/plan", 1
PLAN_FILE = "plan.json"


class PlanError(ValueError):
    """A plan that is inconsistent, or was made for a different teacher: says what differs and what to do."""


def norm_names(config: GemmaConfig) -> tuple[str, ...]:
    names = ("input_layernorm", "post_attention_layernorm")
    if config.uses_sandwich_norms:
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return names


@dataclasses.dataclass
class Plan:
    teacher: dict[str, Any]  # {"source", "revision", "config" (HF config dict), "num_parameters"}
    spec: dict[str, Any]
    student_config: dict[str, Any]
    kept_layers: list[int]
    layer_types: list[str]
    kept_hidden: list[int]
    kept_mlp: list[list[int]]
    kv_groups: list[list[list[int]]]
    kv_weights: list[list[list[float]]]
    kept_heads: list[list[list[int]]]
    embed_scale: float = 1.0
    norm_scales: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"layers": [{name: f}], "final": f}
    methods: dict[str, Any] = dataclasses.field(default_factory=dict)
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        for field in dataclasses.fields(self):  # JSON-native values only, so a round trip compares equal
            setattr(self, field.name, _plain(getattr(self, field.name)))

    # ---------------------------------------------------------------------------------------------- views
    @property
    def teacher_config(self) -> GemmaConfig:
        return GemmaConfig.from_hf_dict(self.teacher["config"], where="plan teacher config")

    @property
    def student(self) -> GemmaConfig:
        return GemmaConfig.from_hf_dict(self.student_config, where="plan student config")

    @property
    def student_spec(self) -> StudentSpec:
        return StudentSpec.from_dict(self.spec)

    def flat_heads(self, layer: int) -> list[int]:
        """Teacher query heads of student layer `layer`, in student head order (KV head major)."""
        return [h for group in self.kept_heads[layer] for h in group]

    def layer_norm_scale(self, layer: int, name: str) -> float:
        layers = self.norm_scales.get("layers") or []
        return float(layers[layer].get(name, 1.0)) if layer < len(layers) else 1.0

    @property
    def final_norm_scale(self) -> float:
        return float(self.norm_scales.get("final", 1.0))

    def without_compensation(self) -> "Plan":
        """The same plan with every embedding and norm factor at 1 (for measuring what compensation does)."""
        return dataclasses.replace(self, embed_scale=1.0, norm_scales={}, methods={**self.methods,
                                                                                   "compensation": "none"})

    # ---------------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        data = {"format": FORMAT}
        data.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        if data.pop("format", FORMAT) != FORMAT:
            raise PlanError(f"not a surgery plan (format {data.get('format')!r}, expected {FORMAT!r}).")
        version = data.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise PlanError(f"plan format_version {version} is newer than this toolkit reads ({FORMAT_VERSION}); "
                            "upgrade nnx-surgery.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"plan has unknown field(s) {sorted(unknown)}.")
        plan = cls(**data)
        plan.validate()
        return plan

    def to_json(self) -> str:
        """One top-level key per line, values compact (score tables stay a few lines long)."""
        items = [f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in self.to_dict().items()]
        return "{\n" + ",\n".join(items) + "\n}\n"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON ({err}).") from None

    def save(self, path: str | os.PathLike) -> str:
        """Write to `path` (a folder gets `plan.json` inside). Returns the file path."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        with open(path) as f:
            return cls.from_json(f.read())

    # ---------------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Internal consistency: counts match the student config, indices are in range and unique, query heads
        sit in the groups they are attached to."""
        teacher, student = self.teacher_config, self.student
        n_s, k_s = student.num_attention_heads, student.num_key_value_heads
        g_s, g_t = n_s // k_s, teacher.num_query_groups
        _check_indices("kept_layers", self.kept_layers, student.num_hidden_layers, teacher.num_hidden_layers)
        if tuple(self.layer_types) != student.layer_types or \
                any(teacher.layer_types[t] != kind for t, kind in zip(self.kept_layers, self.layer_types)):
            raise PlanError("plan layer_types must be the kept teacher layers' attention types, in order, and "
                            "match the student config's layer_types.")
        _check_indices("kept_hidden", self.kept_hidden, student.hidden_size, teacher.hidden_size)
        layer_scales = self.norm_scales.get("layers")
        if not self.embed_scale > 0 or (layer_scales is not None and len(layer_scales) != student.num_hidden_layers):
            raise PlanError("plan embed_scale must be positive and norm_scales['layers'] needs one entry per student "
                            "layer.")
        per_layer = {"kept_mlp": self.kept_mlp, "kv_groups": self.kv_groups, "kv_weights": self.kv_weights,
                     "kept_heads": self.kept_heads}
        for name, value in per_layer.items():
            if len(value) != student.num_hidden_layers:
                raise PlanError(f"plan {name} has {len(value)} entries for {student.num_hidden_layers} student "
                                "layers; give one per student layer.")
        for s in range(student.num_hidden_layers):
            where = f"student layer {s} (teacher layer {self.kept_layers[s]})"
            _check_indices(f"kept_mlp of {where}", self.kept_mlp[s], student.intermediate_size,
                           teacher.intermediate_size)
            groups, weights, heads = self.kv_groups[s], self.kv_weights[s], self.kept_heads[s]
            if len(groups) != k_s or len(heads) != k_s or len(weights) != k_s:
                raise PlanError(f"{where}: kv_groups, kv_weights and kept_heads need one entry per student KV "
                                f"head ({k_s}).")
            used = [g for group in groups for g in group]
            _check_indices(f"kv_groups of {where}", used, len(used), teacher.num_key_value_heads)
            _check_indices(f"kept_heads of {where}", [h for hs in heads for h in hs], n_s,
                           teacher.num_attention_heads)
            for j, (group, w, hs) in enumerate(zip(groups, weights, heads)):
                if not group or len(w) != len(group) or any(x <= 0 for x in w):
                    raise PlanError(f"{where}, KV head {j}: needs at least one teacher KV head and one positive "
                                    "weight per merged head.")
                if len(hs) != g_s or any(h // g_t not in group for h in hs):
                    raise PlanError(f"{where}, KV head {j}: kept_heads {hs} must be {g_s} teacher query heads "
                                    f"from the groups of teacher KV heads {group} (query head h uses KV head "
                                    f"h // {g_t}).")

    def check_teacher(self, config: GemmaConfig, where: str = "teacher") -> None:
        """PlanError unless `config` is the teacher this plan was made for."""
        mine = self.teacher_config
        if mine == config:
            return
        fields = [f.name for f in dataclasses.fields(GemmaConfig) if f.compare]
        diffs = [f"{name}: plan {getattr(mine, name)!r} vs {where} {getattr(config, name)!r}"
                 for name in fields if getattr(mine, name) != getattr(config, name)]
        raise PlanError(f"this plan was made for a different teacher ({self.teacher.get('source') or 'unnamed'}): "
                        f"{'; '.join(diffs[:4])}. Make a plan for this teacher with plan_student().")


def _check_indices(name: str, values: list[int], count: int, bound: int) -> None:
    if len(values) != count:
        raise PlanError(f"plan {name} has {len(values)} indices; the student needs exactly {count}.")
    bad = [v for v in values if not isinstance(v, int) or not 0 <= v < bound]
    if bad:
        raise PlanError(f"plan {name}: indices {bad[:5]} are outside the teacher's range [0, {bound}).")
    if len(set(values)) != len(values):
        dup = sorted({v for v in values if values.count(v) > 1})
        raise PlanError(f"plan {name}: index(es) {dup[:5]} appear more than once; each teacher index can be kept "
                        "once.")


def _plain(value: Any) -> Any:
    """Tuples -> lists, numpy scalars -> Python numbers, recursively (JSON-native)."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value
