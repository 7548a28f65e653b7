"""`Plan`: a surgery decision as plain data, written next to every student it produces.

A plan names the teacher (source, revision, full config), the spec, the student's config, and every index the
student keeps, in teacher numbering:

    kept_layers[s]        teacher layer that becomes student layer s (layer_types[s] is its attention type)
    kept_hidden           teacher hidden channels, shared by every tensor that reads or writes the residual
    kept_mlp[s]           teacher MLP neurons of student layer s (gate/up rows and down columns, paired)
    kv_groups[s][j]       teacher KV heads averaged into student KV head j (one entry: kept as is), with
    kv_weights[s][j]      their weights (the merge is sum(w_i * W_i) / sum(w_i), in float32)
    kept_heads[s][j]      teacher query heads attached to student KV head j, each from a group in kv_groups[s][j]
    kept_vocab            teacher token ids, ascending: student token i is teacher token kept_vocab[i] (embedding
                          and LM head rows; None: the whole vocabulary, see `surgery.plans.vocab_selection`)
    embed_scale           factor on the kept embedding columns (compensates sqrt(hidden) shrinking)
    norm_scales           factor f on each RMSNorm's (1 + w): (1 + w') = (1 + w) * f, with the tied-head fold

plus the scores and method names that led there. Nothing in a plan refers to arrays: it is JSON all the way down,
so `Plan.from_json(plan.to_json()) == plan`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence

import jax
import ml_dtypes
import numpy as np

from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.families.schema import bound_tensors, hf_shape_of, norm_names  # noqa: F401  (norm_names: re-exported)
from nnx_surgery.surgery.plans.student_spec import StudentSpec
from nnx_surgery.surgery.plans.vocab_selection import config_token_ids
from nnx_surgery.surgery.storage.atomic import atomic_file

FORMAT, FORMAT_VERSION = "nnx-surgery/plan", 1
PLAN_FILE = "plan.json"


class PlanError(ValueError):
    """A plan that is inconsistent, or was made for a different teacher: says what differs and what to do."""


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
    kept_vocab: list[int] | None = None
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
    def teacher_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.teacher["config"], where="plan teacher config")

    # The JSON fields `student_config` (config.json dict) and `spec` (StudentSpec dict) are data; these views parse
    # them: `student` is the student's ModelConfig, `student_spec` the StudentSpec it was planned from.
    @property
    def student(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.student_config, where="plan student config")

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
        """A plan from its JSON form; anything malformed (hand edits included) is a PlanError naming the field."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan is a JSON object, not {type(data).__name__}.")
        data = dict(data)
        if data.get("format", FORMAT) != FORMAT:
            raise PlanError(f"not a surgery plan (format {data.get('format')!r}, expected {FORMAT!r}).")
        data.pop("format", None)
        version = data.get("format_version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlanError(f"plan format_version {version!r} is not a positive integer.")
        if version > FORMAT_VERSION:
            raise PlanError(f"plan format_version {version} is newer than this toolkit reads ({FORMAT_VERSION}); "
                            "upgrade nnx-surgery.")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise PlanError(f"plan has unknown field(s) {sorted(unknown)}.")
        required = [name for name, f in fields.items() if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise PlanError(f"plan lacks field(s) {missing}; it was truncated or hand-edited.")
        _check_types(data)
        plan = cls(**data)
        try:
            plan.validate()
        except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError) as err:
            raise PlanError(f"plan is malformed ({type(err).__name__}: {err}); make it again with "
                            "plan_student().") from None
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
        """Write to `path` (a folder gets `plan.json` inside). Returns the file path. Multi-host (`jax.distributed`):
        only process 0 writes (shared storage; the others return the path at once: wait on a barrier before
        reading it elsewhere)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        if jax.distributed.is_initialized() and jax.process_index() != 0:
            return path

        with atomic_file(path) as tmp, open(tmp, "w") as f:
            f.write(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanError(f"{path}: no such plan file; make one with plan_student(...).save(path).") from None
        except (OSError, UnicodeDecodeError) as err:
            raise PlanError(f"{path}: cannot be read as a plan ({err}).") from None
        try:
            return cls.from_json(text)
        except PlanError as err:
            raise PlanError(f"{path}: {err}") from None

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
        _check_vocab(self.kept_vocab, teacher, student)
        layer_scales = self.norm_scales.get("layers")
        if not self.embed_scale > 0 or (layer_scales is not None and len(layer_scales) != student.num_hidden_layers):
            raise PlanError("plan embed_scale must be positive and norm_scales['layers'] needs one entry per student "
                            "layer.")
        per_layer: dict[str, Sequence[object]] = {"kept_mlp": self.kept_mlp, "kv_groups": self.kv_groups,
                                                  "kv_weights": self.kv_weights, "kept_heads": self.kept_heads}
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

    def check_teacher(self, config: ModelConfig, where: str = "teacher", read=None) -> None:
        """PlanError unless `config` is the teacher this plan was made for, and, with `read` (a surgery Reader
        over the teacher's tensors), unless the teacher's weights match the plan's fingerprint of them."""
        mine = self.teacher_config
        if mine == config:
            if read is not None and self.teacher.get("fingerprint") is not None:
                check_fingerprint(self.teacher["fingerprint"], config, read,
                                  f"{where} (plan made for {self.teacher.get('source') or 'an unnamed teacher'})")
            return
        fields = [f.name for f in dataclasses.fields(ModelConfig) if f.compare]
        diffs = [f"{name}: plan {getattr(mine, name)!r} vs {where} {getattr(config, name)!r}"
                 for name in fields if getattr(mine, name) != getattr(config, name)]
        raise PlanError(f"this plan was made for a different teacher ({self.teacher.get('source') or 'unnamed'}): "
                        f"{'; '.join(diffs[:4])}. Make a plan for this teacher with plan_student().")


# ------------------------------------------------------------------------------------------------ fingerprint
FINGERPRINT_COLUMNS = 16  # values per probed row
FINGERPRINT_RTOL = 1e-2  # a teacher loaded in bf16 / f16 still matches; different weights do not


def fingerprint_probes(config: ModelConfig) -> list[tuple[str, list[int], list[int] | None]]:
    """(HF tensor, rows, columns) sampled by the fingerprint: a few rows of the embedding, the first and last
    layers' MLP and the norms, in tensors that both surgery readers slice by plain rows and columns."""
    v, d, f, last = config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers - 1
    cols = lambda n: list(range(min(n, FINGERPRINT_COLUMNS)))  # noqa: E731
    return [("model.embed_tokens.weight", sorted({v // 3, (2 * v) // 3}), cols(d)),
            ("model.layers.0.mlp.gate_proj.weight", sorted({0, f // 2}), cols(d)),
            (f"model.layers.{last}.mlp.down_proj.weight", sorted({0, d // 2}), cols(f)),
            ("model.layers.0.input_layernorm.weight", cols(d), None),
            ("model.norm.weight", cols(d), None)]


def teacher_fingerprint(config: ModelConfig, read) -> dict[str, Any]:
    """What identifies a teacher beyond its config: a hash of every tensor's shape, the probed values (6
    significant digits) and a SHA-256 of them rounded to bfloat16 (equal however the teacher was loaded, unless
    in float16). `read` is a surgery Reader over the teacher (in memory or on disk)."""
    shapes = [(t.hf_name, list(hf_shape_of(config, t))) for t in bound_tensors(config)]
    values = {name: np.asarray(read(name, np.asarray(rows), None if cols is None else np.asarray(cols)),
                               np.float32).reshape(-1) for name, rows, cols in fingerprint_probes(config)}
    flat = np.concatenate(list(values.values()))
    return {"shapes_sha256": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
            "values_sha256": hashlib.sha256(flat.astype(ml_dtypes.bfloat16).tobytes()).hexdigest()[:16],
            "values": {name: [float(f"{x:.6g}") for x in value.tolist()] for name, value in values.items()}}


def check_fingerprint(fingerprint: Any, config: ModelConfig, read, where: str) -> None:
    """PlanError unless the teacher behind `read` has the fingerprint a plan recorded."""
    try:
        stored = {name: np.asarray(values, np.float64) for name, values in fingerprint["values"].items()}
        shapes, digest = fingerprint["shapes_sha256"], fingerprint["values_sha256"]
    except (TypeError, KeyError, AttributeError, ValueError):
        raise PlanError("plan teacher.fingerprint is malformed; make the plan again with plan_student().") from None
    mine = teacher_fingerprint(config, read)
    if mine["shapes_sha256"] != shapes:
        raise PlanError(f"{where}: the teacher's tensor shapes differ from those the plan was made for; make a "
                        "plan for this teacher with plan_student().")
    if mine["values_sha256"] == digest:
        return
    for name, values in mine["values"].items():
        theirs, ours = stored.get(name), np.asarray(values, np.float64)
        if theirs is None or theirs.shape != ours.shape or \
                not np.allclose(ours, theirs, rtol=FINGERPRINT_RTOL, atol=1e-5):
            where_bad = "" if theirs is None or theirs.shape != ours.shape else \
                f" (e.g. {float(theirs[np.argmax(np.abs(ours - theirs))]):.6g} in the plan, " \
                f"{float(ours[np.argmax(np.abs(ours - theirs))]):.6g} here)"
            raise PlanError(f"{where}: this is a different teacher with the same shapes: its {name} differs from "
                            f"the plan's teacher fingerprint{where_bad}. Make a plan for this teacher with "
                            "plan_student(); to apply the plan to it anyway (e.g. a fine-tune of the planned "
                            "teacher), delete teacher.fingerprint from the plan.")


_FIELD_TYPES = {"teacher": dict, "spec": dict, "student_config": dict, "kept_layers": list, "layer_types": list,
                "kept_hidden": list, "kept_mlp": list, "kv_groups": list, "kv_weights": list, "kept_heads": list,
                "norm_scales": dict, "methods": dict, "scores": dict}


def _check_types(data: dict[str, Any]) -> None:
    for name, kind in _FIELD_TYPES.items():
        if name in data and not isinstance(data[name], kind):
            raise PlanError(f"plan field {name} must be a JSON {'object' if kind is dict else 'list'}, found "
                            f"{type(data[name]).__name__}.")
    if not isinstance(data["teacher"].get("config"), dict):
        raise PlanError("plan field teacher.config must be the teacher's config.json object.")
    scale = data.get("embed_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise PlanError(f"plan embed_scale {scale!r} must be a number.")
    nested = {"kept_mlp": 2, "kv_groups": 3, "kv_weights": 3, "kept_heads": 3}
    for name, depth in nested.items():
        if not _nested_lists(data[name], depth, float if name == "kv_weights" else int):
            raise PlanError(f"plan field {name} must be {'lists of ' * (depth - 1)}numbers, one entry per student "
                            "layer.")
    for name in ("kept_layers", "kept_hidden"):
        if not _nested_lists(data[name], 1, int):
            raise PlanError(f"plan field {name} must be a list of integer indices.")
    if data.get("kept_vocab") is not None and not _nested_lists(data["kept_vocab"], 1, int):
        raise PlanError("plan field kept_vocab must be a list of teacher token ids, or null (whole vocabulary).")
    norms = data.get("norm_scales") or {}
    layers, final = norms.get("layers"), norms.get("final", 1.0)
    if (layers is not None and not (isinstance(layers, list) and all(
            isinstance(entry, dict) and _nested_lists(list(entry.values()), 1, float) for entry in layers))) \
            or not _nested_lists(final, 0, float):
        raise PlanError("plan norm_scales must be {'layers': [{norm name: factor}, ...], 'final': factor}.")
    if not all(isinstance(kind, str) for kind in data["layer_types"]):
        raise PlanError("plan layer_types must be attention type names.")


def _check_vocab(kept: list[int] | None, teacher: ModelConfig, student: ModelConfig) -> None:
    """kept_vocab: in range, unique, ascending, with every special id of the teacher's config.json, which the
    student's config.json names by its student id."""
    if kept is None:
        if student.vocab_size != teacher.vocab_size:
            raise PlanError(f"plan student_config has vocab_size {student.vocab_size} but the teacher "
                            f"{teacher.vocab_size}, and no kept_vocab says which pieces it keeps; make the plan "
                            "again with plan_student(StudentSpec(..., vocab_size=N)).")
        return
    _check_indices("kept_vocab", kept, student.vocab_size, teacher.vocab_size)
    if any(a > b for a, b in zip(kept, kept[1:])):
        raise PlanError("plan kept_vocab must list teacher token ids in ascending order (student id i is teacher "
                        "id kept_vocab[i]); sort it and renumber the student's special ids, or plan again.")
    position = {token: i for i, token in enumerate(kept)}
    theirs, mine = config_token_ids(teacher.raw), config_token_ids(student.raw)
    for key, ids in theirs.items():
        ids = [i for i in ids if i < teacher.vocab_size]
        missing = [i for i in ids if i not in position]
        if missing:
            raise PlanError(f"plan kept_vocab lacks teacher token id(s) {missing} ({key} of the teacher's "
                            "config.json); every special token must be kept. Add them, or plan again.")
        if ids and mine.get(key) != [position[i] for i in ids]:
            raise PlanError(f"plan student_config {key}={mine.get(key)} is not the student id of the teacher's "
                            f"{key}={ids} ({[position[i] for i in ids]} with this kept_vocab); plan again.")


def _nested_lists(value: Any, depth: int, kind: type) -> bool:
    if depth == 0:
        return not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    return isinstance(value, list) and all(_nested_lists(v, depth - 1, kind) for v in value)


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
