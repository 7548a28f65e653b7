"""Judging models whose tokenizers differ on the same held-out text: a teacher, and students with a trimmed
vocabulary (a surgery plan's `kept_vocab`: student token i is teacher token kept_vocab[i]).

    vocabularies = {"distilled": Vocabulary(student_folder, plan.kept_vocab), "control": ...}
    report = heldout_report_across(models, held, reference="teacher", vocabularies=vocabularies, pairs=pairs)

Models are grouped by vocabulary. The models without an entry (the reference's group) are scored on `held` as
`heldout_report` does. A group of trimmed students is scored on `held.retokenised(its tokenizer)`, the same
passages (texts, documents, bytes) in its own tokens, against the reference restricted to its pieces
(`TeacherInStudentVocabulary`): KL and top-1 agreement compare each student with the teacher's distribution over
the kept pieces, renormalised, on the student's tokens. CE per token is in each model's own tokens, so between
groups only CE per byte compares: a pair across groups gets the CE-per-byte difference with the paired bootstrap
over documents (passage i is the same text in both sets, so passages and documents pair exactly) and None for the
per-token metrics, with a note saying why. `in_own_tokens` gives `evaluation.suite_scoring`'s prompts and multiple-choice
items in a trimmed student's tokens, so it generates and chooses with its own tokenizer.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from nnx_surgery.evaluation.heldout_sets import HeldoutSet, heldout_report, paired_interval, score_heldout, summarise
from nnx_surgery.distill.trimmed_vocab import TeacherInStudentVocabulary, checked_vocab_map
from nnx_surgery.distill.inputs.batches import load_tokenizer

METRICS = ("ce", "ce_per_byte", "kl", "top1_agreement")
ACROSS_NOTE = ("different tokenizers: CE per token, KL and agreement are in each model's own tokens and do not "
               "compare; CE per byte does (the same passages), with a bootstrap over documents")


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A model's own tokenizer (a folder, tokenizer.json or tokenizer object) and the teacher token id of each of
    its token ids (the plan's `kept_vocab`)."""
    tokenizer: Any
    teacher_ids: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "teacher_ids", tuple(int(i) for i in checked_vocab_map(self.teacher_ids)))


def restricted_name(reference: str, vocabulary: Vocabulary) -> str:
    return f"{reference} restricted to {len(vocabulary.teacher_ids):,} pieces"


def vocabulary_groups(models: Sequence[str], reference: str, vocabularies: Mapping[str, Vocabulary]
                      ) -> list[tuple[Vocabulary | None, list[str]]]:
    """(vocabulary or None for the reference's, model names) in the order of `models`, the reference's first."""
    if reference in vocabularies:
        raise ValueError(f"the reference {reference!r} has a trimmed vocabulary; the reference is the teacher, "
                         "whose vocabulary the others' are cut from.")
    unknown = sorted(set(vocabularies) - set(models))
    if unknown:
        raise ValueError(f"vocabularies names {unknown}, which are not among the models {list(models)}.")
    groups: dict[Any, tuple[Vocabulary | None, list[str]]] = {None: (None, [])}
    for name in models:
        vocabulary = vocabularies.get(name)
        key = None if vocabulary is None else vocabulary.teacher_ids
        groups.setdefault(key, (vocabulary, []))[1].append(name)
    return list(groups.values())


def heldout_report_across(models: Mapping[str, Any], heldout: HeldoutSet, *, reference: str,
                          vocabularies: Mapping[str, Vocabulary], pairs: Sequence[tuple[str, str]] = (),
                          batch_size: int = 8, vocab_chunk: int = 16384, seed: int = 0,
                          log: Callable[[str], None] | None = None) -> dict:
    """`heldout_report` for models with different vocabularies (module docstring): per-model summaries, each in
    its own tokens (trimmed students also say their `vocab_size` and what their KL is against), the comparisons
    of `pairs` (default: every model against the reference), and `tokenizations` (each group's models, scored
    tokens, and the CE per byte of its reference: for a trimmed group the teacher restricted to its pieces, reading
    its tokens, the distribution its distillation aims at, so the CE per byte a student that matched it would
    score)."""
    if not vocabularies:
        return heldout_report(models, heldout, reference=reference, pairs=pairs, batch_size=batch_size,
                              vocab_chunk=vocab_chunk, seed=seed, log=log)
    scores, sets, tokenizations = {}, {}, []
    summaries: dict[str, dict[str, float | int | str]] = {}
    for vocabulary, names in vocabulary_groups(list(models), reference, vocabularies):
        held = heldout if vocabulary is None else heldout.retokenised(vocabulary.tokenizer)
        ref_name = reference if vocabulary is None else restricted_name(reference, vocabulary)
        ref_model = models[reference] if vocabulary is None else \
            TeacherInStudentVocabulary(models[reference], vocabulary.teacher_ids)
        group = {ref_name: ref_model, **{name: models[name] for name in names if name != ref_name}}
        got = score_heldout(group, held, reference=ref_name, batch_size=batch_size, vocab_chunk=vocab_chunk,
                            log=log)
        for name in names:
            scores[name], sets[name] = got[name], held
            summary: dict[str, float | int | str] = dict(summarise(got[name], held))
            if vocabulary is not None:
                summary.update(vocab_size=len(vocabulary.teacher_ids), kl_reference=ref_name)
            summaries[name] = summary
        tokenizations.append({"vocab_size": None if vocabulary is None else len(vocabulary.teacher_ids),
                              "models": names, "tokens": held.tokens, "reference": ref_name,
                              "reference_ce_per_byte": summarise(got[ref_name], held)["ce_per_byte"]})
    comparisons = [_comparison(a, b, scores, sets, seed)
                   for a, b in (list(pairs) or [(name, reference) for name in models if name != reference])]
    return {"name": heldout.name, "description": heldout.description, "tokens": heldout.tokens,
            "bytes": heldout.bytes, "passages": len(heldout.rows), "documents": heldout.num_documents,
            "models": {name: summaries[name] for name in models}, "comparisons": comparisons,
            "tokenizations": tokenizations}


def _comparison(a: str, b: str, scores: dict, sets: dict, seed: int) -> dict:
    """a - b on every metric for two models of one vocabulary; across vocabularies CE per byte alone."""
    same = sets[a] is sets[b]
    entry: dict[str, Any] = {"a": a, "b": b}
    for metric in METRICS:
        if same or metric == "ce_per_byte":  # the same passages in both sets: paired by passage and document
            point, low, high = paired_interval(scores[a], scores[b], sets[a], metric, seed=seed)
            entry[metric] = {"difference": point, "low": low, "high": high}
        else:
            entry[metric] = None
    if not same:
        entry["note"] = ACROSS_NOTE
    return entry




def in_own_tokens(prompts: Sequence[Any], items: Sequence[Any], tokenizer: Any) -> tuple[list, list]:
    """`evaluation.suite_scoring`'s prompts and multiple-choice items in another tokenizer's tokens (a trimmed student's):
    the same texts, encoded by it, with its own start token; what the model generates is decoded by it too."""

    tok = load_tokenizer(tokenizer)
    head = [tok.bos_id] if tok.add_bos else []
    prompt_ids = tok.encode_batch([p.text for p in prompts]) if prompts else []
    context_ids = tok.encode_batch([i.context for i in items]) if items else []
    return ([dataclasses.replace(p, ids=head + list(ids)) for p, ids in zip(prompts, prompt_ids)],
            [dataclasses.replace(i, context_ids=head + list(ids), choice_ids=[list(c) for c in
                                                                              tok.encode_batch(list(i.choices))])
             for i, ids in zip(items, context_ids)])


def trimmed_note_lines(result: dict) -> list[str]:
    """Lines for `evaluation.suite_scoring`'s Markdown saying how its trimmed students were judged (none: no line)."""
    trimmed = result.get("vocabularies") or {}
    if not trimmed:
        return []
    return ["", f"{', '.join(f'{n} ({v:,} pieces)' for n, v in trimmed.items())}: a trimmed vocabulary. They are "
                "prompted, generate and choose in their own tokens (decoded by their own tokenizer); on the held-out "
                "sets their KL and agreement are against the teacher restricted to their pieces, and CE per byte, "
                "not per token, compares them with the teacher."]


__all__ = ["Vocabulary", "heldout_report_across", "vocabulary_groups", "restricted_name", "in_own_tokens",
           "trimmed_note_lines", "ACROSS_NOTE"]
