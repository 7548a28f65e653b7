"""`plan_student`: decide which layers, channels, neurons and heads a student keeps, and how its KV heads form.

It only decides; `apply_plan` and `prune_checkpoint` carry the decision out. Every choice can be overridden by an
explicit index list, and every score that drove a choice is stored in the plan.

Depth (`depth=`): "block_influence" (1 - cos(layer input, layer output) on calibration data), "loss" (increase of
the calibration LM loss when the layer is skipped), or "uniform" (evenly spaced, data-free); the layers with the
lowest scores go. Width (`width=`): "activation" (Minitron) or "magnitude" (data-free weight norms). Widths are
uniform across layers. KV heads: see `surgery.plans.student_spec` ("select" or "merge", `kv_merge` "mean" or "importance").

Compensation (`compensate=True`), for families that multiply embeddings by sqrt(hidden_size)
(`config.scales_embeddings`, e.g. Gemma): a narrower student would start its residual stream sqrt(H_s / H_t)
smaller than the teacher's. The kept embedding columns are scaled by c = sqrt(H_t / H_s), restoring the teacher's
values, and when the embedding is also the (tied) LM head, 1 / c is folded into the final norm's effective weight
((1 + w) for Gemma). Measured on tiny teachers of all three Gemma generations, this lowered KL(teacher || student) in
every case, so it is on by default. Families that do not scale embeddings (Llama) need no embedding factor.

Vocabulary (`StudentSpec(vocab_size=N)`, needs calibration): the special tokens, the byte pieces, then the pieces
most frequent in the calibration data, closed under the BPE merges of the teacher's tokenizer.json (`surgery.plans.vocab_selection`);
`plan.kept_vocab` lists them and `scores["vocab"]` says what was kept and dropped.

`norm_correction=True` (needs calibration; any family) also multiplies every RMSNorm's effective weight by
r = sqrt(H_t / H_s * share of its input energy in the kept channels), undoing the change of its mean-square
statistic when it averages over fewer channels. It is exact when the removed channels carry no energy, but on
random teachers it raised the starting KL slightly (mostly through the final norm), so it is off by default.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
from typing import Any, Sequence

import numpy as np

from ..pruning.in_memory import compensation_effect
from ..storage.hf_checkpoint import load_pretrained, resolve_source
from ..modeling.model_config import ModelConfig
from .importance import SCORES, ScoreInputs, calibration_batches
from ..modeling.causal_lm import CausalLM
from nnx_surgery.surgery.plans.plan_record import FORMAT_VERSION, Plan, PlanError, norm_names, teacher_fingerprint
from nnx_surgery.surgery.storage.tensor_readers import DiskReader, MemoryReader, Reader
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec
from nnx_surgery.surgery.plans.vocab_selection import (TeacherTokenizer, calibration_counts, choose_vocabulary,
                                                       with_vocabulary)

KV_MERGES = ("mean", "importance")


def plan_student(teacher: CausalLM | str | os.PathLike, spec: StudentSpec | str, *, calibration=None,
                 batch_size: int = 8, num_samples: int | None = None, seed: int = 0, depth: str = "auto",
                 width: str = "auto", kv_mode: str = "auto", kv_merge: str = "mean",
                 layers: Sequence[int] | None = None, hidden: Sequence[int] | None = None,
                 mlp: Sequence | None = None, heads: Sequence | None = None, kv_groups: Sequence | None = None,
                 compensate: bool = True, norm_correction: bool = False, measure_compensation: bool = False,
                 source: str | None = None, revision: str | None = None, mesh=None,
                 tokenizer: str | os.PathLike | None = None, vocab_calibration=None,
                 scored: TeacherScores | None = None) -> Plan:
    """Decide a student of shape `spec` (a StudentSpec or a named shape such as "gemma-2b") for `teacher`.

    `teacher` is an NNX model or an HF folder / repo id. From a folder without calibration data, scores are
    computed tensor by tensor from disk (the teacher is never loaded); with calibration it is loaded (over `mesh`).
    `calibration`: token ids (N, T) or an iterable of (B, T) batches; `num_samples` picks a `seed`ed subset for the
    model passes (the vocabulary counts pieces in all of it).
    Explicit overrides (teacher indices): `layers`; `hidden`; `mlp` (one list for every layer, or one per student
    layer); `heads` (teacher query heads in student order, one list or one per layer); `kv_groups` (per student KV
    head, the teacher KV heads it is formed from; one list of lists or one per layer).
    `compensate`: embedding rescale with the final-norm fold, for families that scale embeddings (module
    docstring). `norm_correction` (needs calibration; off by default, it raised the student's starting KL slightly
    in our measurements): also rescale every RMSNorm for its fewer channels. `measure_compensation`: build the
    student with and without compensation and store both KL(teacher || student) values on the calibration data in
    `scores["compensation"]`. `tokenizer`: where the teacher's tokenizer.json is (a folder or the file), for a
    spec with `vocab_size`; default: the teacher's folder, else `source` when it is a folder.
    `vocab_calibration`: token ids (like `calibration`) whose piece counts choose a trimmed vocabulary, e.g. the
    whole training corpus while the model passes score a few rows of it; default: all of `calibration`.
    `scored`: `score_teacher`'s measurements of this teacher on the same calibration rows and methods, used instead
    of measuring again (plans of many shapes from one calibration pass; ValueError if they were made otherwise).
    """
    spec = StudentSpec.named(spec) if isinstance(spec, str) else spec
    every, batches = _calibration(calibration, batch_size, num_samples, seed)
    counted = every if vocab_calibration is None else calibration_batches(vocab_calibration, batch_size)
    depth, width = _methods(depth, width, kv_merge, batches, explicit_layers=layers is not None,
                            norm_correction=norm_correction)
    if source is None and not isinstance(teacher, CausalLM):
        source = os.fspath(teacher)
    with contextlib.ExitStack() as stack:  # checkpoint files stay open while scores are read from disk
        model, config, read = _teacher(teacher, calibration, revision, mesh, stack)
        formation = spec.check_against(config, kv_mode)
        if tokenizer is None and spec.vocab_size is not None:
            tokenizer = _tokenizer_folder(teacher, source, revision)
        kept_vocab, vocab_record = _vocabulary(spec, config, counted, tokenizer)  # before the long scoring passes
        methods = (depth if layers is None else "explicit", width)
        scores, stats = (_scores(model, config, read, batches, *methods) if scored is None else
                         scored.reuse(*methods, _calibration_record(batches, batch_size, num_samples, seed)))
        fingerprint = teacher_fingerprint(config, read)

    kept_layers = _choose_layers(config, spec, depth, layers, scores)
    kept_hidden, kept_mlp = _widths(config, spec, kept_layers, scores, hidden, mlp)
    attention = _attention_per_layer(config, spec, formation, kv_merge, kept_layers, scores, heads, kv_groups)
    student = spec.config_for(config, kept_layers)
    student = student if kept_vocab is None else with_vocabulary(student, kept_vocab)
    embed_scale, norm_scales = _compensation(config, student, kept_layers, kept_hidden,
                                             stats if norm_correction else None, compensate)
    merged = any(len(group) > 1 for groups, _, _ in attention for group in groups)
    plan = Plan(
        teacher={"source": source, "revision": revision, "config": config.to_hf_dict(),
                 "num_parameters": config.num_parameters(), "fingerprint": fingerprint},
        spec=spec.to_dict(), student_config=student.to_hf_dict(), kept_layers=kept_layers,
        layer_types=list(student.layer_types), kept_hidden=kept_hidden, kept_mlp=kept_mlp,
        kv_groups=[a[0] for a in attention], kv_weights=[a[1] for a in attention],
        kept_heads=[a[2] for a in attention], kept_vocab=kept_vocab, embed_scale=embed_scale,
        norm_scales=norm_scales,
        methods={"depth": "explicit" if layers is not None else depth, "width": width,
                 "kv": f"merge-{kv_merge}" if merged else "select",
                 "aggregation": "sequence mean, batch L2" if width == "activation" else None,
                 "compensation": _compensation_label(config, compensate, norm_correction),
                 **({"vocab": "calibration frequency, closed under BPE merges"} if kept_vocab else {})},
        scores={**scores, **({"vocab": vocab_record} if kept_vocab else {})},
        calibration=_calibration_record(batches, batch_size, num_samples, seed),
        format_version=FORMAT_VERSION)
    plan.validate()
    # calibration batches come with the teacher model (_teacher loads it for them)
    if measure_compensation and batches is not None and model is not None and (embed_scale != 1.0 or norm_scales):
        effect = compensation_effect(model, plan, batches)
        plan.scores["compensation"] = {k: {m: _rounded(v) for m, v in d.items()} for k, d in effect.items()}
    return plan


@dataclasses.dataclass(frozen=True)
class TeacherScores:
    """What `plan_student` measures on a teacher before it chooses anything: the scores of its depth and width
    methods on the calibration rows, and the rows' activation statistics. No student shape changes them, so
    `score_teacher` measures them once and `plan_student(..., scored=)` plans any number of shapes from them
    (the shape search's candidates), to the same plans."""

    depth: str
    width: str
    calibration: dict | None  # _calibration_record of the rows measured
    scores: dict[str, Any]
    stats: Any

    def reuse(self, depth: str, width: str, calibration: dict | None) -> tuple[dict[str, Any], Any]:
        """(scores, stats) for a plan with these methods and calibration rows, or ValueError."""
        if (depth, width, calibration) != (self.depth, self.width, self.calibration):
            raise ValueError(f"scored= holds depth {self.depth!r} / width {self.width!r} on calibration "
                             f"{self.calibration}, but this plan uses depth {depth!r} / width {width!r} on "
                             f"{calibration}; call score_teacher with the plan's calibration and methods.")
        return self.scores, self.stats


def score_teacher(teacher: CausalLM | str | os.PathLike, *, calibration=None, batch_size: int = 8,
                  num_samples: int | None = None, seed: int = 0, depth: str = "auto", width: str = "auto",
                  revision: str | None = None, mesh=None) -> TeacherScores:
    """The teacher's measurements (`TeacherScores`) that `plan_student` with the same arguments would make."""
    batches = _calibration(calibration, batch_size, num_samples, seed)[1]
    depth, width = _methods(depth, width, KV_MERGES[0], batches, explicit_layers=False, norm_correction=False)
    with contextlib.ExitStack() as stack:
        model, config, read = _teacher(teacher, calibration, revision, mesh, stack)
        scores, stats = _scores(model, config, read, batches, depth, width)
    return TeacherScores(depth, width, _calibration_record(batches, batch_size, num_samples, seed), scores, stats)


def _calibration(calibration, batch_size: int, num_samples: int | None, seed: int) -> tuple[Any, Any]:
    """(every calibration batch, the batches the model passes score: a `seed`ed subset of `num_samples` rows), or
    (None, None) without calibration data."""
    every = calibration_batches(calibration, batch_size) if calibration is not None else None
    batches = every if every is None or num_samples is None else \
        calibration_batches(np.concatenate(every), batch_size, num_samples, seed)
    return every, batches


def _methods(depth: str, width: str, kv_merge: str, batches, *, explicit_layers: bool,
             norm_correction: bool) -> tuple[str, str]:
    """The depth and width methods ("auto" resolved by whether there is calibration data), or SpecError. Methods
    are the registered scores (importance.SCORES) plus depth "uniform"."""
    depths = ("auto", *[n for n, score in SCORES.items() if score.kind == "depth"], "uniform")
    widths = ("auto", *[n for n, score in SCORES.items() if score.kind == "width"])
    if depth not in depths or width not in widths or kv_merge not in KV_MERGES:
        raise SpecError(f"depth={depth!r}, width={width!r}, kv_merge={kv_merge!r}: choose depth from "
                        f"{depths}, width from {widths}, kv_merge from {KV_MERGES}.")
    depth = ("block_influence" if batches else "uniform") if depth == "auto" else depth
    width = ("activation" if batches else "magnitude") if width == "auto" else width
    depth_needs = depth != "uniform" and not explicit_layers and SCORES[depth].needs_calibration
    if batches is None and (depth_needs or SCORES[width].needs_calibration):
        raise SpecError(f"depth={depth!r} / width={width!r} need calibration token ids; pass calibration=..., or "
                        "use depth='uniform' and width='magnitude' (data-free), or give explicit indices.")
    if norm_correction and batches is None:
        raise SpecError("norm_correction=True measures each norm's input on calibration data; pass calibration=.")
    return depth, width


def _scores(model, config, read, batches, depth: str, width: str) -> tuple[dict[str, Any], Any]:
    """Every score the plan records (rounded for JSON), and the raw calibration statistics (or None). With
    calibration data the block influence is always recorded (the statistics also feed norm correction)."""
    inputs = ScoreInputs(config, read, model, batches)
    scores: dict[str, Any] = {}
    if batches is not None:
        scores["block_influence"] = _rounded(inputs.stats.block_influence)
    for method in (depth, width):
        if method in SCORES:
            scores.update({name: _rounded(value) for name, value in SCORES[method].compute(inputs).items()})
    return scores, inputs.stats if batches is not None else None


# ------------------------------------------------------------------------------------------------ teacher access
def _teacher(teacher, calibration, revision, mesh,
             stack: contextlib.ExitStack) -> tuple[CausalLM | None, ModelConfig, Reader]:
    """(model or None, config, read) for an NNX teacher or an HF source."""
    if isinstance(teacher, CausalLM):
        return teacher, teacher.config, MemoryReader(teacher)
    folder = resolve_source(teacher, revision)
    if calibration is not None:
        model = load_pretrained(folder, mesh=mesh)
        return model, model.config, MemoryReader(model)
    config = ModelConfig.from_file(folder)
    return None, config, DiskReader(folder, np.float32, stack, config)


def _tokenizer_folder(teacher, source, revision) -> str | None:
    """Where the teacher's tokenizer is by default: its folder (a Hub teacher's snapshot), or `source` when that
    is a folder."""
    if not isinstance(teacher, CausalLM):
        return resolve_source(teacher, revision)
    return source if source is not None and os.path.isdir(source) else None


# ------------------------------------------------------------------------------------------------ choices
def _vocabulary(spec: StudentSpec, config: ModelConfig, batches, tokenizer) -> tuple[list[int] | None, dict]:
    """(kept teacher token ids, their record) for a spec with a vocab_size, else (None, {})."""
    size = spec.vocab_size_for(config)
    if size is None:
        return None, {}
    if tokenizer is None:
        raise SpecError(f"vocab_size={spec.vocab_size} chooses pieces of the teacher's tokenizer, but none was "
                        "found: pass tokenizer= the teacher's folder (or its tokenizer.json), or plan from the "
                        "teacher's folder.")
    if batches is None:
        raise SpecError(f"vocab_size={spec.vocab_size} keeps the pieces the calibration data uses most; pass "
                        "calibration= token ids of text from the student's domain.")
    return choose_vocabulary(TeacherTokenizer.read(tokenizer), config, calibration_counts(batches, config.vocab_size),
                             size)


def _choose_layers(config: ModelConfig, spec: StudentSpec, depth: str, layers, scores) -> list[int]:
    total, keep = config.num_hidden_layers, spec.num_layers
    if layers is not None:
        chosen = _explicit("layers", layers, keep, total, keep_order=True)
        if chosen != sorted(chosen):
            raise SpecError(f"layers={list(layers)} must be in increasing order; a student keeps the teacher's "
                            "layer order.")
        return chosen
    if depth == "uniform":
        return [int(round(x)) for x in np.linspace(0, total - 1, keep)] if keep > 1 else [0]
    return _top(np.asarray(scores[SCORES[depth].ranks_by]), keep)


def _widths(config: ModelConfig, spec: StudentSpec, kept_layers: list[int], scores, hidden,
            mlp) -> tuple[list[int], list[list[int]]]:
    """(kept hidden channels, kept MLP neurons per student layer): the top-scoring ones unless given."""
    kept_hidden = _top(np.asarray(scores["hidden"]), spec.hidden_size) if hidden is None else \
        _explicit("hidden", hidden, spec.hidden_size, config.hidden_size)
    mlp_lists = _per_layer("mlp", mlp, len(kept_layers))
    kept_mlp = [_top(np.asarray(scores["mlp"][t]), spec.intermediate_size) if mlp_lists[s] is None else
                _explicit(f"mlp[{s}]", mlp_lists[s], spec.intermediate_size, config.intermediate_size)
                for s, t in enumerate(kept_layers)]
    return kept_hidden, kept_mlp


def _attention_per_layer(config: ModelConfig, spec: StudentSpec, formation: str, kv_merge: str,
                         kept_layers: list[int], scores, heads, kv_groups) -> list[tuple[list, list, list]]:
    """`_attention` for every student layer."""
    head_lists = _per_layer("heads", heads, len(kept_layers))
    group_lists = _per_layer("kv_groups", kv_groups, len(kept_layers), depth_of_item=2)
    return [_attention(config, spec, formation, kv_merge, np.asarray(scores["heads"][t]), head_lists[s],
                       group_lists[s], f"student layer {s}") for s, t in enumerate(kept_layers)]


def _attention(config: ModelConfig, spec: StudentSpec, formation: str, kv_merge: str, importance: np.ndarray,
               heads, groups, where: str) -> tuple[list, list, list]:
    """(kv_groups, kv_weights, kept_heads) for one student layer."""
    k_t, g_t = config.num_key_value_heads, config.num_query_groups
    k_s = spec.num_key_value_heads
    g_s = spec.num_attention_heads // k_s
    members = lambda group: [h for g in group for h in range(g * g_t, (g + 1) * g_t)]  # noqa: E731
    if heads is not None:
        heads = _explicit(f"heads of {where}", heads, spec.num_attention_heads, config.num_attention_heads,
                          keep_order=True)
        chunks = [heads[j * g_s:(j + 1) * g_s] for j in range(k_s)]
    if groups is not None:
        groups = [sorted(int(g) for g in group) for group in groups]
        if len(groups) != k_s:
            raise SpecError(f"kv_groups of {where}: {len(groups)} groups for {k_s} student KV heads.")
        flat = [g for group in groups for g in group]
        if not all(0 <= g < k_t for g in flat) or len(set(flat)) != len(flat):
            raise SpecError(f"kv_groups of {where}: {groups} must use distinct teacher KV heads in [0, {k_t}).")
        small = [group for group in groups if len(group) * g_t < g_s]
        if small:
            raise SpecError(f"kv_groups of {where}: {small[0]} has {len(small[0]) * g_t} query heads, but each "
                            f"student KV head needs {g_s}; merge more teacher KV heads into it.")
    elif formation == "merge":
        size = k_t // k_s
        groups = [list(range(j * size, (j + 1) * size)) for j in range(k_s)]
    elif heads is not None:
        groups = []
        for chunk in chunks:
            owners = sorted({h // g_t for h in chunk})
            if len(owners) != 1:
                raise SpecError(f"heads of {where}: query heads {chunk} share student KV head {len(groups)} but "
                                f"belong to teacher KV heads {owners}; with kv_mode='select' each run of {g_s} "
                                "heads must come from one teacher group (or use kv_mode='merge').")
            groups.append(owners)
    else:  # select: the groups whose best g_s query heads carry the most importance
        value = [np.sort(importance[g * g_t:(g + 1) * g_t])[::-1][:g_s].sum() for g in range(k_t)]
        groups = [[g] for g in _top(np.asarray(value), k_s)]
    if heads is None:
        chunks = [sorted(_pick(importance, members(group), g_s)) for group in groups]
    for j, (group, chunk) in enumerate(zip(groups, chunks)):
        if any(h // g_t not in group for h in chunk):
            raise SpecError(f"heads of {where}: student KV head {j} is formed from teacher KV heads {group}, but "
                            f"query heads {chunk} include heads of other groups; each query head must stay with "
                            f"its KV group (teacher query head h uses KV head h // {g_t}).")
    if kv_merge == "importance":
        weights = [[max(float(importance[g * g_t:(g + 1) * g_t].sum()), 0.0) or 1.0 for g in group]
                   for group in groups]
        weights = [[_round(w / sum(ws)) for w in ws] if len(ws) > 1 else [1.0] for ws in weights]
    else:
        weights = [[1.0] * len(group) for group in groups]
    return groups, weights, [list(chunk) for chunk in chunks]


def _compensation(teacher: ModelConfig, student: ModelConfig, kept_layers, kept_hidden, stats,
                  compensate: bool) -> tuple[float, dict[str, Any]]:
    """(embed_scale, norm_scales) for the plan (module docstring). The factors multiply each norm's effective
    weight, whatever its form ((1 + w) or w); `surgery.pruning.tensor_slices` applies them in the family's form."""
    if not compensate or student.hidden_size == teacher.hidden_size:
        return 1.0, {}
    ratio = teacher.hidden_size / student.hidden_size
    embed_scale = math.sqrt(ratio) if teacher.scales_embeddings else 1.0
    if stats is None and embed_scale == 1.0:
        return 1.0, {}
    kept = np.asarray(kept_hidden)

    def factor(share: np.ndarray) -> float:
        return _round(math.sqrt(ratio * float(share[kept].sum()))) if stats is not None else 1.0

    scales: dict[str, Any] = {}
    if stats is not None:
        scales["layers"] = [{name: factor(stats.norm_energy[name][t]) for name in norm_names(teacher)}
                            for t in kept_layers]
    final = factor(stats.norm_energy["final"]) if stats is not None else 1.0
    # The tied LM head is the scaled embedding: undo its factor on the logits through the final norm.
    scales["final"] = _round(final / embed_scale) if teacher.tie_word_embeddings else final
    return _round(embed_scale), scales


def _compensation_label(config: ModelConfig, compensate: bool, norm_correction: bool) -> str:
    """What `_compensation` does for this family, as recorded in the plan's methods."""
    parts = (["embedding"] if config.scales_embeddings else []) + (["norms"] if norm_correction else [])
    return "+".join(parts) if compensate and parts else "none"


# ------------------------------------------------------------------------------------------------ helpers
def _top(values: np.ndarray, count: int) -> list[int]:
    """Indices of the `count` largest values (ties: lower index first), in increasing order."""
    order = np.lexsort((np.arange(len(values)), -np.asarray(values, dtype=np.float64)))
    return sorted(int(i) for i in order[:count])


def _pick(importance: np.ndarray, candidates: list[int], count: int) -> list[int]:
    values = np.asarray([importance[h] for h in candidates])
    return [candidates[i] for i in _top(values, count)]


def _explicit(name: str, values, count: int, bound: int, keep_order: bool = False) -> list[int]:
    values = [int(v) for v in values]
    if len(values) != count:
        raise SpecError(f"{name}: {len(values)} indices given, the spec needs exactly {count}.")
    bad = [v for v in values if not 0 <= v < bound]
    if bad or len(set(values)) != len(values):
        raise SpecError(f"{name}: indices must be distinct and in [0, {bound}); got {values[:8]}"
                        f"{'...' if len(values) > 8 else ''}.")
    return values if keep_order else sorted(values)


def _per_layer(name: str, value, num_layers: int, depth_of_item: int = 1) -> list:
    """An override given once for every layer, or once per student layer -> one entry per student layer."""
    if value is None:
        return [None] * num_layers
    value = list(value)
    nested = value and isinstance(value[0], (list, tuple, np.ndarray))
    if depth_of_item == 2:
        nested = nested and len(value[0]) and isinstance(value[0][0], (list, tuple, np.ndarray))
    if not nested:
        return [value] * num_layers
    if len(value) != num_layers:
        raise SpecError(f"{name}: {len(value)} per-layer entries for {num_layers} student layers; give one list "
                        "for all layers or one per student layer.")
    return value


def _calibration_record(batches, batch_size, num_samples, seed) -> dict | None:
    if batches is None:
        return None
    tokens = np.concatenate([b.reshape(-1) for b in batches])
    return {"sequences": int(sum(len(b) for b in batches)), "length": int(batches[0].shape[1]),
            "batch_size": batch_size, "num_samples": num_samples, "seed": seed,
            "sha256": hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()[:16]}


def _round(x: float) -> float:
    return float(f"{float(x):.9g}")


def _rounded(value):
    """Scores as short floats (6 significant digits) so plan.json stays small and round-trips exactly."""
    if np.ndim(value) == 0:
        return float(f"{float(value):.6g}")
    return [_rounded(v) for v in value]


__all__ = ["plan_student", "score_teacher", "TeacherScores", "PlanError"]
