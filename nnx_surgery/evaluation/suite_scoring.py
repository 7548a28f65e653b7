"""The evaluation a student is judged by: several models side by side on held-out text.

    result = evaluate_suite({"teacher": t, "pruned": p, "distilled": s, "control": c}, batches, documents,
                            tokenizer=folder, generate=surgery.generate, out_path="runs/x/suite.md")

Per model: held-out cross-entropy and perplexity; top-1 agreement with the reference model (the teacher) and
KL(reference || model) per scored token; greedy continuations of held-out prompts scored against the reference's
with BLEU (sacrebleu, corpus level) and ROUGE-L F1 (rouge-score, mean over prompts, x100, on code-aware tokens:
words and single punctuation marks); a next-line multiple-choice task; and the sample continuations themselves.

Prompts and multiple-choice items are cut from held-out documents (strings, e.g. `TokenBatches.eval_texts()`) at
line boundaries, deterministically from `seed`. A multiple-choice item is the true next line of a held-out
document among `distractors` lines drawn from other held-out documents (from elsewhere in the same document when
there is only one), each re-indented like the true line so indentation alone does not give the answer. The
model picks the candidate with the highest mean log-likelihood per token given the preceding lines (length-
normalised, the reported `accuracy`; the summed log-likelihood's accuracy is reported too). Chance is
1 / (distractors + 1).

`distill` does not import `surgery`: generation is the `generate(model, prompt_ids, max_new_tokens) -> new ids`
argument (`surgery.generate` binds it). Continuations are cut at the first EOS before decoding.

Multi-host (`jax.distributed`): every process runs the suite together, with its own rows of the held-out batches
(`TokenBatches(process_index=, process_count=)`) and all the held-out documents; the scores are computed on the
global batches (`evaluation.perplexity.batch_arrays`), prompts and multiple-choice items are the same on every process,
so every process returns the same result, and only process 0 writes the files.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from nnx_surgery.distill.inputs.batches import DataError, TextTokenizer, load_tokenizer
from nnx_surgery.evaluation.degeneration import LoopRule, degeneration, text_units
from nnx_surgery.distill.distributed import say as say_on_main
from nnx_surgery.evaluation.perplexity import agreement_and_kl, heldout_loss, parameter_count, sequence_loglikelihoods
from nnx_surgery.evaluation.heldout_sets import HeldoutSet
from nnx_surgery.evaluation.cross_vocab import Vocabulary, heldout_report_across, in_own_tokens
from nnx_surgery.evaluation.suite_report import suite_markdown, write_suite

GenerateFn = Callable[[Any, list[list[int]], int], list[list[int]]]


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    prompts: int = 8  # held-out prompts for continuations and samples
    prompt_tokens: int = 96  # at most, whole lines
    min_prompt_tokens: int = 16
    new_tokens: int = 48  # greedy continuation length
    choice_items: int = 64  # multiple-choice items
    distractors: int = 3  # wrong lines per item
    context_tokens: int = 96  # multiple-choice context, at most, whole lines
    line_tokens: int = 48  # longest candidate line
    choice_documents: int = 256  # at most this many held-out documents supply multiple-choice lines
    seed: int = 0
    score_batch: int = 8  # rows per scoring forward
    vocab_chunk: int = 16384  # vocabulary block of the agreement/KL pass


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]  # BOS (when the tokenizer adds one) + the text's tokens
    document: int
    line: int  # the continuation starts at this line of the document


@dataclasses.dataclass(frozen=True)
class ChoiceItem:
    context: str
    context_ids: list[int]  # BOS + context tokens
    choices: list[str]
    choice_ids: list[list[int]]
    answer: int  # index of the true line in `choices`


# ------------------------------------------------------------------------------------------------ held-out text
def _prefix(tok: TextTokenizer) -> list[int]:
    if not tok.add_bos:
        return []
    if tok.bos_id is None:
        raise ValueError("the tokenizer adds a BOS token but has no bos_id.")
    return [tok.bos_id]


def _encode(tok: TextTokenizer, text: str) -> list[int]:
    return list(tok.encode_batch([text])[0])


def _window(lines: list[str], end: int, tok: TextTokenizer, max_tokens: int) -> tuple[str, list[int]]:
    """The longest run of whole lines ending before line `end` whose tokens fit in `max_tokens`."""
    counts = [len(ids) for ids in tok.encode_batch(lines[max(0, end - max_tokens):end])]
    start, total = end, 0
    for count in reversed(counts):
        if total + count > max_tokens:
            break
        start, total = start - 1, total + count
    while start < end:  # per-line counts are an estimate: the joined text is what counts
        ids = _encode(tok, "".join(lines[start:end]))
        if len(ids) <= max_tokens:
            return "".join(lines[start:end]), ids
        start += 1
    return "", []


def heldout_prompts(documents: Sequence[str], tokenizer: Any, *, count: int = 8, max_tokens: int = 96,
                    min_tokens: int = 16, seed: int = 0) -> list[Prompt]:
    """Up to `count` prompts: whole lines ending at a random line boundary followed by a non-blank line, at most
    `max_tokens` and at least `min_tokens` tokens. The documents are visited in an order drawn from `seed`, one
    prompt each; when they give fewer than `count`, further passes take more from them at other lines (a held-out
    set of a few long modules still gives enough continuations to measure how often a model loops). The first pass
    is the same whatever `count`, so asking for more prompts only adds some."""
    tok = load_tokenizer(tokenizer)
    rng = np.random.default_rng([seed, 0x9E7])
    prompts: list[Prompt] = []
    left: dict[int, tuple[list[str], list[int]]] = {}  # document -> (its lines, boundaries not yet tried)
    order = [int(index) for index in rng.permutation(len(documents))]
    while order and len(prompts) < count:
        giving = []
        for index in order:
            if index not in left:
                lines = documents[index].splitlines(keepends=True)
                cuts = [c for c in range(1, len(lines)) if lines[c].strip()]
                left[index] = (lines, [int(c) for c in rng.permutation(cuts)] if cuts else [])
            prompt = _next_prompt(*left[index], index, tok, max_tokens, min_tokens)
            if prompt is not None:
                prompts.append(prompt)
                giving.append(index)
                if len(prompts) == count:
                    break
        order = giving  # a document that gave no prompt in 4 tries is not asked again
    return prompts


def _next_prompt(lines: list[str], cuts: list[int], index: int, tok: TextTokenizer, max_tokens: int,
                 min_tokens: int) -> Prompt | None:
    """A prompt of document `index` (its `lines`) from the first of up to 4 of `cuts` (consumed) that gives one,
    else None."""
    for _ in range(min(4, len(cuts))):
        cut = cuts.pop(0)
        text, ids = _window(lines, cut, tok, max_tokens)
        if len(ids) >= min_tokens and text.strip():
            return Prompt(text, _prefix(tok) + ids, index, cut)
    return None


def _candidate_lines(documents: Sequence[str], chosen: Sequence[int], tok: TextTokenizer,
                     max_tokens: int) -> list[tuple[int, int, str]]:
    """(document, line, stripped text) of every non-blank line of at most `max_tokens` tokens of the documents
    `chosen`."""
    found = []
    for index in chosen:
        lines = documents[index].splitlines()
        lengths = [len(ids) for ids in tok.encode_batch([line.strip() + "\n" for line in lines])] if lines else []
        found += [(index, number, line.strip()) for number, (line, n) in enumerate(zip(lines, lengths))
                  if line.strip() and n <= max_tokens]
    return found


def _distractors(pool: list[tuple[int, int, str]], document: int, true_text: str, count: int,
                 rng: np.random.Generator, single: bool) -> list[str]:
    """`count` distinct lines unlike `true_text`, from documents other than `document` (from any when the pool
    has a `single` document): random draws first, then a scan of the rest in a random order."""
    wrong: list[str] = []

    def consider(entry) -> None:
        if (single or entry[0] != document) and entry[2] != true_text and entry[2] not in wrong:
            wrong.append(entry[2])

    for draw in rng.integers(0, len(pool), 20 * count):
        consider(pool[draw])
        if len(wrong) == count:
            return wrong
    for index in rng.permutation(len(pool)):
        consider(pool[index])
        if len(wrong) == count:
            return wrong
    raise DataError(f"the held-out documents give fewer than {count} distinct distractor lines; pass more held-out "
                    "text or fewer distractors.")


def multiple_choice_items(documents: Sequence[str], tokenizer: Any, *, count: int = 64, distractors: int = 3,
                          context_tokens: int = 96, line_tokens: int = 48, seed: int = 0,
                          max_documents: int = 256) -> list[ChoiceItem]:
    """Up to `count` next-line items (module docstring), drawn from `seed`, from at most `max_documents` of the
    documents (drawn from `seed` too: a large held-out set is not tokenised line by line in full)."""
    tok = load_tokenizer(tokenizer)
    rng = np.random.default_rng([seed, 0xC401CE])
    chosen = sorted(rng.permutation(len(documents))[:max_documents].tolist())
    pool = _candidate_lines(documents, chosen, tok, line_tokens)
    single = len({entry[0] for entry in pool}) == 1
    items: list[ChoiceItem] = []
    for pick in rng.permutation(len(pool)):
        document, number, true_text = pool[pick]
        lines = documents[document].splitlines(keepends=True)
        context, context_ids = _window(lines, number, tok, context_tokens)
        if not context.strip() or not context.endswith("\n"):
            continue
        wrong = _distractors(pool, document, true_text, distractors, rng, single)
        indent = lines[number][:len(lines[number]) - len(lines[number].lstrip())]
        choices = [indent + text + "\n" for text in [true_text] + wrong]
        order = rng.permutation(len(choices))
        choices = [choices[i] for i in order]
        items.append(ChoiceItem(context, _prefix(tok) + context_ids, choices,
                                [list(ids) for ids in tok.encode_batch(choices)], int(np.argmin(order))))
        if len(items) == count:
            break
    return items


# ------------------------------------------------------------------------------------------------ scores
def multiple_choice(model: Any, items: Sequence[ChoiceItem], *, pad_id: int = 0, batch_size: int = 8) -> dict:
    """Accuracy of picking the true line: by mean log-likelihood per candidate token (`accuracy`) and by summed
    log-likelihood (`accuracy_unnormalised`); ties count as wrong. `chance` = 1 / number of choices."""
    if not items:
        raise DataError("multiple_choice: no items; give held-out documents with enough non-blank lines.")
    sequences = [(item.context_ids + ids, len(item.context_ids)) for item in items for ids in item.choice_ids]
    length = -(-max(len(s) for s, _ in sequences) // 8) * 8
    rows = np.full((len(sequences), length), pad_id, np.int32)
    scored = np.zeros(rows.shape, bool)
    for r, (sequence, start) in enumerate(sequences):
        rows[r, :len(sequence)] = sequence
        scored[r, start:len(sequence)] = True
    totals, counts = sequence_loglikelihoods(model, rows, scored, batch_size=batch_size)
    normalised, summed, offset = [], [], 0
    for item in items:
        total, count = totals[offset:offset + len(item.choices)], counts[offset:offset + len(item.choices)]
        offset += len(item.choices)
        normalised.append(_unique_best(total / np.maximum(count, 1)) == item.answer)
        summed.append(_unique_best(total) == item.answer)
    return {"accuracy": float(np.mean(normalised)), "accuracy_unnormalised": float(np.mean(summed)),
            "chance": 1.0 / len(items[0].choices), "items": len(items)}


def _unique_best(scores: np.ndarray) -> int:
    best = int(np.argmax(scores))
    return best if np.sum(scores == scores[best]) == 1 else -1


LOOP_RULE = LoopRule()


class _CodeTokenizer:
    """rouge-score's tokenizer interface: words and single punctuation marks, case kept (code, not prose)."""

    def tokenize(self, text: str) -> list[str]:
        return text_units(text)


def continuation_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu, 0-100) and mean ROUGE-L F1 (x100) of `hypotheses` against `references`."""
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"continuation_scores: {len(hypotheses)} hypotheses for {len(references)} references.")
    bleu = sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_CodeTokenizer())
    # two continuations without a token (e.g. only newlines) are identical: F1 1, where rouge-score says 0
    rouge = [scorer.score(ref, hyp)["rougeL"].fmeasure if text_units(hyp) or text_units(ref) else 1.0
             for hyp, ref in zip(hypotheses, references)]
    return {"bleu": float(bleu), "rouge_l": 100.0 * float(np.mean(rouge))}


def continuations(model: Any, prompts: Sequence[Prompt], generate: GenerateFn, tokenizer: TextTokenizer,
                  new_tokens: int) -> list[str]:
    """Greedy continuations of `prompts` by `model`, cut at the first EOS and decoded."""
    if tokenizer.decode is None:
        raise DataError("scoring generations needs the tokenizer's decode; pass a tokenizer folder/object, or "
                        "load_tokenizer(callable, decode=...).")
    new_ids = generate(model, [list(p.ids) for p in prompts], new_tokens)
    if len(new_ids) != len(prompts):
        raise ValueError(f"generate returned {len(new_ids)} continuations for {len(prompts)} prompts.")
    texts = []
    for ids in new_ids:
        ids = [int(i) for i in ids]
        ids = ids[:ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids
        texts.append(tokenizer.decode(ids))
    return texts


# ------------------------------------------------------------------------------------------------ the suite
def evaluate_suite(models: Mapping[str, Any], batches: Sequence[dict[str, Any]] | None, documents: Sequence[str],
                   *, tokenizer: Any, generate: GenerateFn, reference: str = "teacher",
                   settings: SuiteSettings = SuiteSettings(), out_path: str | os.PathLike | None = None,
                   heldout_sets: Sequence[HeldoutSet] = (), pairs: Sequence[tuple[str, str]] = (),
                   log: Callable[[str], None] | None = None,
                   vocabularies: Mapping[str, Vocabulary] | None = None) -> dict:
    """Score every model of `models` (name -> model, in table order) on held-out `batches` (pipeline dicts, e.g.
    `TokenBatches.eval_batches()`; None to skip), on each of `heldout_sets` (`evaluation.HeldoutSet`: CE per token
    and per byte, KL, agreement, and the paired differences of `pairs` with 95% intervals; e.g. an in-domain and
    a general-domain set) and on held-out `documents` (strings, e.g. `TokenBatches.eval_texts()`: prompts and
    multiple-choice items), against `models[reference]`. Returns a JSON-serialisable dict (`models`: metrics per
    model; `sets`: each held-out set's report; `samples`: every model's continuation of each prompt;
    `multiple_choice`, `settings`); with `out_path`, also writes it as Markdown (metrics table, the sets, then the
    samples) and as JSON next to it (same name, .json). `log` gets a line per finished part (default: print).
    `vocabularies`: models with a trimmed vocabulary (name -> `evaluation.cross_vocab.Vocabulary`), scored in their
    own tokens on the held-out sets against the reference restricted to their pieces, prompted and asked in their
    own tokens, their continuations decoded by their own tokenizer (`batches`, in one tokenizer's ids, must be None)."""
    if reference not in models:
        raise ValueError(f"reference {reference!r} is not one of the models {list(models)}; pass reference=.")
    vocabularies = dict(vocabularies or {})
    if vocabularies and batches is not None:
        raise ValueError("evaluate_suite: batches are in one tokenizer's ids, but vocabularies gives models their "
                         "own; pass batches=None and judge them on heldout_sets (each model in its own tokens).")
    say = log or say_on_main
    tok = load_tokenizer(tokenizer)
    prompts = heldout_prompts(documents, tok, count=settings.prompts, max_tokens=settings.prompt_tokens,
                              min_tokens=settings.min_prompt_tokens, seed=settings.seed)
    items = multiple_choice_items(documents, tok, count=settings.choice_items, distractors=settings.distractors,
                                  context_tokens=settings.context_tokens, line_tokens=settings.line_tokens,
                                  seed=settings.seed, max_documents=settings.choice_documents)
    if not prompts:
        raise DataError(f"no held-out document gives a prompt of {settings.min_prompt_tokens}+ tokens that ends at "
                        "a line boundary; pass more held-out text or lower min_prompt_tokens.")
    sets = {held.name: heldout_report_across(models, held, reference=reference, vocabularies=vocabularies,
                                             pairs=pairs, batch_size=settings.score_batch,
                                             vocab_chunk=settings.vocab_chunk, seed=settings.seed, log=say)
            for held in heldout_sets}
    own = {name: (load_tokenizer(vocabularies[name].tokenizer), *in_own_tokens(prompts, items,
                                                                               vocabularies[name].tokenizer))
           if name in vocabularies else (tok, prompts, items) for name in models}  # (tokenizer, prompts, items)
    started = time.perf_counter()
    texts = {name: continuations(model, own[name][1], generate, own[name][0], settings.new_tokens)
             for name, model in models.items()}
    say(f"[eval] greedy continuations of {len(prompts)} prompts by {len(models)} models "
        f"({time.perf_counter() - started:.0f} s)")
    rows = {}
    for name, model in models.items():
        started = time.perf_counter()
        row: dict[str, Any] = {"parameters": parameter_count(model)}
        if batches is not None:
            row.update(heldout_loss(model, batches))
            row["eval_tokens"] = row.pop("tokens")
        row["sets"] = {set_name: report["models"][name] for set_name, report in sets.items()}
        degenerate = degeneration(texts[name], LOOP_RULE)
        row.update(loop_share=degenerate["loop_share"], distinct_2=degenerate["distinct_2"])
        if name == reference:
            row.update(top1_agreement=None, kl=None, bleu=None, rouge_l=None)  # 1, 0, 100, 100 by definition
        else:
            if batches is not None:
                row.update(agreement_and_kl(model, models[reference], batches, vocab_chunk=settings.vocab_chunk))
                row.pop("tokens")
            row.update(continuation_scores(texts[name], texts[reference]))
        choice = multiple_choice(model, own[name][2], pad_id=own[name][0].pad_id, batch_size=settings.score_batch)
        row.update(mc_accuracy=choice["accuracy"], mc_accuracy_unnormalised=choice["accuracy_unnormalised"])
        rows[name] = row
        say(f"[eval] {name}: continuation scores and {len(items)} multiple-choice items "
            f"({time.perf_counter() - started:.0f} s)")
    result = {
        "reference": reference, "models": rows, "sets": sets, "settings": dataclasses.asdict(settings),
        "vocabularies": {name: len(v.teacher_ids) for name, v in vocabularies.items()},
        "degeneration": {"loop": LOOP_RULE.describe(), "units": "words and punctuation marks of the decoded text",
                         "continuations": len(prompts)},
        "multiple_choice": {"items": len(items), "choices": settings.distractors + 1,
                            "chance": 1.0 / (settings.distractors + 1),
                            "scored_by": "mean log-likelihood per token of the candidate line (length-normalised)"},
        "samples": [{"prompt": p.text, "document": p.document, "line": p.line,
                     "continuations": {name: texts[name][i] for name in models}} for i, p in enumerate(prompts)],
    }
    if out_path is not None:
        write_suite(result, out_path)
    return result



__all__ = ["SuiteSettings", "Prompt", "ChoiceItem", "GenerateFn", "evaluate_suite", "heldout_prompts",
           "multiple_choice_items", "multiple_choice", "continuations", "continuation_scores", "suite_markdown",
           "write_suite", "agreement_and_kl", "heldout_loss"]
