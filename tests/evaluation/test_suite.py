"""evaluation.suite_scoring and the scoring functions of evaluation.perplexity, each against an independent computation on tiny
models: agreement and KL from full float32 logits, log-likelihoods from full log-softmaxes, ROUGE-L from a plain
LCS, a multiple-choice task whose answer is known by construction, and the whole suite (a model scored against
itself gives KL 0, agreement 1, BLEU 100) with its Markdown and JSON files."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.distill.inputs.batches import DataError, TokenBatches, load_tokenizer
from nnx_surgery.evaluation.perplexity import agreement_and_kl, heldout_loss, sequence_loglikelihoods
from nnx_surgery.evaluation.degeneration import degeneration, text_units
from nnx_surgery.evaluation.suite_scoring import (SuiteSettings, continuation_scores, evaluate_suite,
                                                  heldout_prompts, multiple_choice, multiple_choice_items)
from nnx_surgery.distill.inputs.byte_tokenizer import EOS_ID, VOCAB_SIZE, save_byte_tokenizer

from suite_fixtures import DOCUMENTS, SETTINGS, greedy, surgery_greedy, tiny_gemma

@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def models():
    return tiny_gemma(3, seed=0), tiny_gemma(2, seed=1)


@pytest.fixture(scope="module")
def heldout(tokenizer_folder):
    data = TokenBatches.from_records(DOCUMENTS * 2, tokenizer_folder, seq_len=48, batch_size=2, eval_documents=4,
                                     eval_batch_size=2, seed=3)
    return data.eval_batches(), data.eval_texts()


def full_logprobs(model, batch):
    """float32 log-softmax of the full logits, the way a reader would compute it."""
    keys = {k: jnp.asarray(batch[k]) for k in ("positions", "segment_ids", "attention_mask") if k in batch}
    return np.asarray(jax.nn.log_softmax(model(jnp.asarray(batch["input_ids"]), **keys).logits, -1), np.float64)


def scored_weights(batch):
    mask = np.asarray(batch["loss_mask"], np.float64).copy()
    mask[:, -1] = 0.0
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        mask[:, :-1] *= (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    return mask


def test_agreement_and_kl_equal_full_float32_logits(models, heldout):
    teacher, student = models
    batches, _ = heldout
    got = agreement_and_kl(student, teacher, batches, vocab_chunk=96, row_chunk=32)  # 260 = 96 + 96 + clamped 68
    kl_sum = agree_sum = count = 0.0
    for batch in batches:
        lt, ls = full_logprobs(teacher, batch), full_logprobs(student, batch)
        w = scored_weights(batch)
        kl_sum += np.sum(w * np.sum(np.exp(lt) * (lt - ls), -1))
        agree_sum += np.sum(w * (lt.argmax(-1) == ls.argmax(-1)))
        count += w.sum()
    assert got["tokens"] == count > 50
    assert got["kl"] == pytest.approx(kl_sum / count, rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(agree_sum / count, abs=1e-9)
    assert 0.0 < got["top1_agreement"] < 1.0 and got["kl"] > 0.1
    itself = agreement_and_kl(teacher, teacher, batches, vocab_chunk=64)
    assert itself["top1_agreement"] == 1.0 and abs(itself["kl"]) < 1e-5


def test_loglikelihoods_and_heldout_loss_equal_full_log_softmax(models, heldout):
    _, student = models
    batches, _ = heldout
    nll = count = 0.0
    for batch in batches:
        lp = full_logprobs(student, batch)[:, :-1]
        target = np.take_along_axis(lp, np.asarray(batch["input_ids"])[:, 1:, None], -1)[..., 0]
        w = scored_weights(batch)[:, :-1]
        nll, count = nll - np.sum(w * target), count + w.sum()
    got = heldout_loss(student, batches)
    assert got["tokens"] == count and got["loss"] == pytest.approx(nll / count, rel=1e-5)

    rng = np.random.default_rng(0)
    rows = rng.integers(4, VOCAB_SIZE, (5, 16)).astype(np.int32)
    scored = np.zeros(rows.shape, bool)
    scored[:, 6:] = True
    scored[2, 12:] = False  # a shorter candidate: right padding is not scored
    totals, counts = sequence_loglikelihoods(student, rows, scored, batch_size=4)  # 5 rows: one padded batch
    lp = full_logprobs(student, {"input_ids": rows})
    want = [sum(lp[r, t - 1, rows[r, t]] for t in range(16) if scored[r, t]) for r in range(5)]
    np.testing.assert_allclose(totals, want, rtol=1e-5)
    np.testing.assert_array_equal(counts, scored.sum(1))


def test_models_of_one_shape_share_the_scoring_programs(models, heldout):
    """Two students of one shape and dtype (other weights) are scored by the programs compiled for the first: the
    graph is a static argument of module-level jits, not a closure made per call."""
    from nnx_surgery.evaluation import perplexity

    teacher, student = models
    twin = tiny_gemma(2, seed=7)
    batches, _ = heldout
    rows = np.full((3, 16), 5, np.int32)
    scored = np.zeros(rows.shape, bool)
    scored[:, 8:] = True
    programs = (perplexity._heldout_sums, perplexity._window_sums, perplexity._compare_sums)
    for model in (student, twin):  # the first call compiles (or finds what earlier tests compiled)
        before = [program._cache_size() for program in programs]
        heldout_loss(model, batches)
        sequence_loglikelihoods(model, rows, scored, batch_size=4)
        agreement_and_kl(model, teacher, batches)
        after = [program._cache_size() for program in programs]
    assert after == before
    assert heldout_loss(twin, batches)["loss"] != heldout_loss(student, batches)["loss"]


class LagCopy(nnx.Module):
    """A model that predicts token t + 1 to be token t + 1 - `lag` (scaled by `strength`; negative: avoids it).
    Documents of identical lines of `lag` tokens are then perfectly predictable: the answer of a next-line item
    is known by construction. Implements the DistillModel interface with a one-hot 'hidden state'."""

    def __init__(self, lag: int, strength: float):
        self.lag, self.strength = lag, strength
        self.head = nnx.Param(jnp.eye(VOCAB_SIZE, dtype=jnp.float32))

    def head_matrix(self):
        return self.head[...]

    def logits_from_hidden(self, hidden, head=None):
        return jnp.einsum("...D,VD->...V", hidden, self.head[...] if head is None else head)

    def __call__(self, input_ids, *, positions=None, attention_mask=None, segment_ids=None, capture=(),
                 return_logits=True, inputs_embeds=None):
        source = jnp.pad(input_ids, ((0, 0), (self.lag - 1, 0)))[:, :input_ids.shape[1]]
        hidden = jax.nn.one_hot(source, VOCAB_SIZE) * self.strength
        return _Output(hidden, self.logits_from_hidden(hidden) if return_logits else None)


class _Output:
    def __init__(self, final_hidden, logits):
        self.final_hidden, self.logits, self.residual, self.attention_probs = final_hidden, logits, None, None


def test_multiple_choice_answer_known_by_construction(tokenizer_folder):
    # five documents of identical 8-byte lines, one letter each: the true next line repeats the previous one
    documents = ["\n".join([letter * 7] * 12) + "\n" for letter in "abcde"]
    items = multiple_choice_items(documents, tokenizer_folder, count=10, distractors=3, context_tokens=40, seed=1)
    assert len(items) == 10 and len({item.answer for item in items}) > 1
    for item in items:
        assert len(set(item.choices)) == 4 and item.context.endswith("\n")
        truth = item.context.splitlines()[-1] + "\n"  # every line of a document is the same
        assert [c == truth for c in item.choices].index(True) == item.answer
        assert item.context_ids[0] == 2 and len(item.context_ids) <= 41
    copier = multiple_choice(LagCopy(8, 10.0), items, batch_size=8)
    assert copier == {"accuracy": 1.0, "accuracy_unnormalised": 1.0, "chance": 0.25, "items": 10}
    avoider = multiple_choice(LagCopy(8, -10.0), items, batch_size=8)
    assert avoider["accuracy"] == 0.0 and avoider["accuracy_unnormalised"] == 0.0


def test_prompts_are_whole_held_out_lines(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    prompts = heldout_prompts(DOCUMENTS, tok, count=3, max_tokens=40, min_tokens=8, seed=0)
    assert len(prompts) == 3 and len({p.document for p in prompts}) == 3
    for prompt in prompts:
        lines = DOCUMENTS[prompt.document].splitlines(keepends=True)
        assert prompt.text.endswith("\n") and "".join(lines[:prompt.line]).endswith(prompt.text)
        assert lines[prompt.line].strip()  # a continuation follows
        assert prompt.ids == [2] + tok.encode_batch([prompt.text])[0] and 8 <= len(prompt.ids) - 1 <= 40
    assert prompts == heldout_prompts(DOCUMENTS, tok, count=3, max_tokens=40, min_tokens=8, seed=0)


def test_more_prompts_than_documents_come_from_other_lines_of_them(tokenizer_folder):
    """Asking for more prompts than there are documents takes further ones from other lines of the same
    documents (so a few long held-out modules still give enough continuations to count loops); the first pass,
    one per document, is the same prompts in the same order whatever the count."""
    tok = load_tokenizer(tokenizer_folder)
    first = heldout_prompts(DOCUMENTS, tok, count=len(DOCUMENTS), max_tokens=40, min_tokens=8, seed=1)
    more = heldout_prompts(DOCUMENTS, tok, count=3 * len(DOCUMENTS), max_tokens=40, min_tokens=8, seed=1)
    assert more[:len(first)] == first and len({p.document for p in first}) == len(first)
    assert len(more) > len(first) and len({(p.document, p.line) for p in more}) == len(more)
    for prompt in more:
        lines = DOCUMENTS[prompt.document].splitlines(keepends=True)
        assert "".join(lines[:prompt.line]).endswith(prompt.text) and lines[prompt.line].strip()
        assert 8 <= len(prompt.ids) - 1 <= 40
    short = ["a = 1\n", "", "no newline"]  # no line boundary with a prompt of 8+ tokens: nothing, and it stops
    assert heldout_prompts(short, tok, count=5, max_tokens=40, min_tokens=8, seed=0) == []


def _lcs(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_continuation_scores():
    refs = ["total = a + b\n    return total", "for name in names:\n    print(name)"]
    hyps = ["total = a - b\n    return", "while name in names:\n    print(name, end='')"]
    same = continuation_scores(refs + ["\n\n"], refs + ["\n\n"])  # blank continuations are identical too
    assert same["bleu"] == pytest.approx(100.0) and same["rouge_l"] == pytest.approx(100.0)
    assert continuation_scores(["\n", "x = 1"], ["y", "x = 1"])["rouge_l"] == pytest.approx(50.0)
    want = []
    for hyp, ref in zip(hyps, refs):
        h, r = text_units(hyp), text_units(ref)
        lcs = _lcs(h, r)
        want.append(2 * lcs / (len(h) + len(r)))  # F1 of precision lcs/|h| and recall lcs/|r|
    got = continuation_scores(hyps, refs)
    assert got["rouge_l"] == pytest.approx(100 * np.mean(want))
    assert 0 < got["bleu"] < 100


def test_suite_end_to_end_writes_markdown(models, heldout, tokenizer_folder, tmp_path):
    teacher, student = models
    batches, texts = heldout
    clone = nnx.clone(teacher)
    out = tmp_path / "suite.md"
    result = evaluate_suite({"teacher": teacher, "copy": clone, "student": student}, batches, texts,
                            tokenizer=tokenizer_folder, generate=surgery_greedy, settings=SETTINGS, out_path=out)
    rows = result["models"]
    assert list(rows) == ["teacher", "copy", "student"]
    assert rows["copy"]["top1_agreement"] == 1.0 and abs(rows["copy"]["kl"]) < 1e-5
    # the copy continues every prompt exactly as the teacher does (BLEU 100 needs 4-grams: the random teacher's
    # continuations may be one undecodable word, so the copy's BLEU is that of identical texts)
    teacher_texts = [s["continuations"]["teacher"] for s in result["samples"]]
    assert [s["continuations"]["copy"] for s in result["samples"]] == teacher_texts
    assert rows["copy"]["bleu"] == pytest.approx(continuation_scores(teacher_texts, teacher_texts)["bleu"])
    assert rows["copy"]["rouge_l"] == pytest.approx(100.0)
    assert rows["copy"]["loss"] == rows["teacher"]["loss"]
    assert rows["copy"]["mc_accuracy"] == rows["teacher"]["mc_accuracy"]
    assert rows["teacher"]["kl"] is None
    direct = agreement_and_kl(student, teacher, batches, vocab_chunk=96)
    assert rows["student"]["kl"] == pytest.approx(direct["kl"], rel=1e-6)
    assert rows["student"]["perplexity"] == pytest.approx(np.exp(heldout_loss(student, batches)["loss"]))
    assert rows["student"]["parameters"] == sum(x.size for x in jax.tree.leaves(nnx.state(student, nnx.Param)))
    assert result["multiple_choice"]["chance"] == 0.25 and result["multiple_choice"]["items"] == 6
    samples = result["samples"]
    assert len(samples) == 3 and all(set(s["continuations"]) == set(rows) for s in samples)
    tok = load_tokenizer(tokenizer_folder)
    prompts = heldout_prompts(texts, tok, count=3, max_tokens=40, min_tokens=8, seed=0)
    new = greedy(student, [p.ids for p in prompts], 12)  # full forwards: surgery.generate's KV cache agrees
    expected = [tok.decode(ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids) for ids in new]
    assert [s["continuations"]["student"] for s in samples] == expected
    for name in rows:  # every model's degeneration, the reference's included, from its own continuations
        assert {k: rows[name][k] for k in ("loop_share", "distinct_2")} == {
            k: v for k, v in degeneration([s["continuations"][name] for s in samples]).items() if k != "continuations"}
    markdown = out.read_text()
    assert markdown.startswith("| model | parameters | held-out CE (nats) |")
    assert "| teacher |" in markdown and "(reference)" in markdown and "## Sample generations" in markdown
    assert json.loads((tmp_path / "suite.json").read_text()) == json.loads(json.dumps(result))


def test_multiple_choice_items_from_one_document_and_too_few_lines(tokenizer_folder):
    lines = "".join(f"value_{i} = {i}\n" for i in range(8))
    items = multiple_choice_items([lines], tokenizer_folder, count=3, distractors=2, seed=0)
    assert len(items) == 3
    for item in items:
        end = lines.index(item.context) + len(item.context)
        assert item.choices[item.answer] == lines[end:].splitlines(keepends=True)[0]  # the line after the context
        assert all(c in lines for c in item.choices) and len(set(item.choices)) == 3
    with pytest.raises(DataError, match="distinct distractor lines"):
        multiple_choice_items(["x = 1\ny = 2\nx = 1\n"], tokenizer_folder, count=1, distractors=2)
