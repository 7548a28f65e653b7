"""evaluation.heldout_sets: passages, per-passage scores, per-byte losses and the paired bootstrap, each against an
independent computation (full float32 log-softmaxes in numpy, bytes counted from the text, a normal-theory
interval for a synthetic difference), and the general-domain prose set that no training corpus touches."""
import jax
import numpy as np
import pytest

from nnx_surgery import distill
from nnx_surgery.distill.inputs.batches import DataError, load_tokenizer
from nnx_surgery.evaluation.heldout_sets import (HeldoutSet, heldout_report, paired_interval, report_markdown,
                                                 score_heldout, summarise)
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
from suite_fixtures import DOCUMENTS, tiny_gemma


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(str(path))
    return str(path)


def full_scores(model, reference, heldout):
    """Per passage: NLL under both models, KL(ref || model), top-1 agreements and tokens from whole logits."""
    logits = np.asarray(model(jax.numpy.asarray(heldout.rows)).logits, np.float64)
    ref = np.asarray(reference(jax.numpy.asarray(heldout.rows)).logits, np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(logits), log_softmax(ref)
    targets = np.concatenate([heldout.rows[:, 1:], np.zeros((len(heldout.rows), 1), int)], axis=1)
    take = lambda a: np.take_along_axis(a, targets[..., None], -1)[..., 0]  # noqa: E731
    kl = (np.exp(lq) * (lq - lp)).sum(-1)
    agree = (lp.argmax(-1) == lq.argmax(-1)).astype(float)
    mask = heldout.loss_mask
    return {"nll": -(take(lp) * mask).sum(-1), "ref_nll": -(take(lq) * mask).sum(-1), "kl": (kl * mask).sum(-1),
            "agree": (agree * mask).sum(-1), "tokens": mask.sum(-1)}


def test_passages_keep_whole_lines_the_bytes_and_the_token_budget(folder):
    tok = load_tokenizer(folder)
    held = HeldoutSet.from_texts("code", DOCUMENTS, folder, seq_len=24)
    assert held.rows.shape[1] == 24 and held.loss_mask.sum(-1).max() <= 23
    start = tok.bos_id if tok.add_bos else tok.eos_id
    texts = {d: "" for d in range(len(DOCUMENTS))}
    for row, mask, document in zip(held.rows, held.loss_mask, held.documents):
        n = int(mask.sum())
        assert row[0] == start and mask[:n].all() and not mask[n:].any()
        texts[document] += tok.decode(row[1:n + 1].tolist())
    assert [texts[d] for d in range(len(DOCUMENTS))] == DOCUMENTS  # every byte, once, in order
    assert held.bytes == sum(len(d.encode()) for d in DOCUMENTS) and held.num_documents == len(DOCUMENTS)
    small = HeldoutSet.from_texts("code", DOCUMENTS, folder, seq_len=24, max_tokens=60)
    assert 60 <= small.tokens < 60 + 23 and small.tokens < held.tokens
    with pytest.raises(DataError, match="no passage"):
        HeldoutSet.from_texts("empty", [""], folder, seq_len=24)


def test_scores_match_full_logits_and_per_byte_divides_by_the_text(folder):
    held = HeldoutSet.from_texts("code", DOCUMENTS, folder, seq_len=32)
    teacher, student = tiny_gemma(2, seed=0), tiny_gemma(1, seed=1)
    lines = []
    scores = score_heldout({"teacher": teacher, "student": student}, held, reference="teacher", batch_size=4,
                           vocab_chunk=96, log=lines.append)
    assert len(lines) == 2 and "1/1 student" in lines[-1]
    expect = full_scores(student, teacher, held)
    for key in ("nll", "ref_nll", "kl", "agree", "tokens"):
        np.testing.assert_allclose(scores["student"][key], expect[key], rtol=2e-4, atol=2e-4, err_msg=key)
    np.testing.assert_allclose(scores["teacher"]["kl"], 0.0, atol=1e-3)
    np.testing.assert_allclose(scores["teacher"]["agree"], scores["teacher"]["tokens"])
    np.testing.assert_allclose(scores["teacher"]["nll"], scores["student"]["ref_nll"], rtol=1e-6)
    # the reference alone (every other model of a report has its own vocabulary): its scores from its own hidden
    # states, the same as beside a student, with a line of its own
    alone_lines = []
    alone = score_heldout({"teacher": teacher}, held, reference="teacher", batch_size=4, vocab_chunk=96,
                          log=alone_lines.append)["teacher"]
    np.testing.assert_allclose(alone["nll"], expect["ref_nll"], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(alone["kl"], 0.0, atol=1e-3)
    np.testing.assert_allclose(alone["agree"], alone["tokens"])
    assert len(alone_lines) == 2 and alone_lines[-1].startswith("[eval code] teacher: CE ")
    summary = summarise(scores["student"], held)
    assert summary["ce"] == pytest.approx(expect["nll"].sum() / expect["tokens"].sum(), rel=1e-5)
    assert summary["ce_per_byte"] == pytest.approx(expect["nll"].sum() / sum(len(d.encode()) for d in DOCUMENTS),
                                                   rel=1e-5)
    assert summary["kl"] == pytest.approx(expect["kl"].sum() / expect["tokens"].sum(), rel=1e-4, abs=1e-6)


def test_paired_bootstrap_matches_normal_theory_and_is_zero_for_one_model():
    rng = np.random.default_rng(3)
    documents = np.repeat(np.arange(200), 2)  # two passages per document
    tokens = np.full(400, 50.0)
    a = rng.normal(2.0, 0.3, 400) * 50
    b = a - 50 * (0.1 + rng.normal(0, 0.2, 400))  # b is 0.1 nats/token better on average, noisy
    held = HeldoutSet("synthetic", np.zeros((400, 4), np.int32), np.ones((400, 4), np.float32), documents,
                      np.full(400, 200))
    sa, sb = ({"nll": x, "kl": x, "agree": x, "tokens": tokens} for x in (a, b))
    point, low, high = paired_interval(sa, sb, held, "ce", samples=4000)
    per_document = (a - b).reshape(200, 2).sum(1) / 100  # the difference per token of each document
    se = per_document.std(ddof=1) / np.sqrt(200)
    assert point == pytest.approx(per_document.mean())
    assert low == pytest.approx(point - 1.96 * se, abs=0.3 * se) and high == pytest.approx(point + 1.96 * se,
                                                                                          abs=0.3 * se)
    assert low < 0.1 < high and low > 0
    per_byte = paired_interval(sa, sb, held, "ce_per_byte", samples=500)
    assert per_byte[0] == pytest.approx(point / 4)  # 200 bytes for 50 tokens
    assert paired_interval(sa, sa, held, "ce", samples=200) == (0.0, 0.0, 0.0)
    assert paired_interval(sa, sb, held, "ce", samples=300, seed=1) == paired_interval(sa, sb, held, "ce",
                                                                                          samples=300, seed=1)


def test_report_compares_pairs_and_renders(folder):
    held = HeldoutSet.from_texts("code", DOCUMENTS, folder, seq_len=32, description="four snippets")
    models = {"teacher": tiny_gemma(2, seed=0), "a": tiny_gemma(1, seed=1), "b": tiny_gemma(1, seed=2)}
    report = heldout_report(models, held, reference="teacher", pairs=[("a", "b")], vocab_chunk=96, log=lambda _: 0)
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("a", "b")]
    diff = report["comparisons"][0]["ce"]
    assert diff["difference"] == pytest.approx(report["models"]["a"]["ce"] - report["models"]["b"]["ce"], abs=1e-9)
    assert diff["low"] <= diff["difference"] <= diff["high"]
    text = report_markdown(report, "teacher")
    assert "four snippets" in text and "| a | b |" in text and "(reference)" in text


def test_general_prose_is_english_disjoint_and_never_training_text():
    parts = {name: distill.general_prose(name) for name in ("heldout", "aside", "train")}
    assert all(parts.values())
    assert not set(parts["heldout"]) & set(parts["aside"]) and not set(parts["heldout"]) & set(parts["train"])
    assert sum(len(t) for t in parts["heldout"]) > 200_000  # tens of thousands of tokens for any tokenizer
    text = " ".join(parts["heldout"])
    assert text.count(" the ") > 1000  # prose
    assert not any("pydoc_data" in path for path in distill.stdlib_corpus())
    with pytest.raises(DataError, match="unknown"):
        distill.general_prose("test")


def test_far_prose_comes_from_no_training_source_and_spans_many_documents(monkeypatch, tmp_path):
    """The far-domain set: English prose in enough documents for intervals, no line of it in the stdlib corpus's
    files or the pydoc topics (training text and the general mix's source); an install without the files is one
    DataError."""
    far = distill.far_prose()
    assert len(far) >= 32 and sum(len(t) for t in far) > 50_000
    assert " ".join(far).count(" the ") > 500
    lines = {line.strip() for text in far for line in text.splitlines() if len(line.split()) >= 8}  # sentences
    pydoc = {line.strip() for text in distill.general_prose("train") + distill.general_prose("heldout")
             for line in text.splitlines()}
    assert len(lines) > 300 and not lines & pydoc
    trained = set()  # every line of the training corpus, comment marks stripped
    for path in distill.stdlib_corpus():
        with open(path, encoding="utf-8", errors="replace") as handle:
            trained |= {line.strip().lstrip("#").strip() for line in handle}
    assert not lines & trained, sorted(lines & trained)[:3]
    import sysconfig
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(DataError, match="far_prose: none of LICENSE.txt"):
        distill.far_prose()


def test_general_mix_trains_only_and_keeps_the_held_out_split(folder):
    records = [f"document {i}\n" + "line of code\n" * (5 + i) for i in range(40)]
    alone = distill.TokenBatches.from_records(records, folder, seq_len=32, batch_size=2, seed=3)
    mix = distill.general_mix(sum(len(r) for r in records), 0.5)
    mixed = distill.TokenBatches.from_records(records, folder, seq_len=32, batch_size=2, seed=3, extra_train=mix)
    assert mixed.eval_texts() == alone.eval_texts()  # the same held-out documents, no prose among them
    assert len(mixed.train_indices) == len(alone.train_indices) + len(mix) and mixed.num_rows > alone.num_rows
    prose = distill.general_prose("train")
    assert mix[:len(prose)] == prose and len(mix) % len(prose) == 0
    share = sum(len(t) for t in mix) / (sum(len(t) for t in mix) + sum(len(r) for r in records))
    assert 0.4 < share < 0.95  # at least one whole copy of the prose
    big = distill.general_mix(10_000_000, 0.25)
    assert abs(sum(len(t.encode()) for t in big) / (10_000_000 + sum(len(t.encode()) for t in big)) - 0.25) < 0.02
    assert distill.general_mix(10_000_000, 0.0) == []
    with pytest.raises(DataError, match="fraction"):
        distill.general_mix(1000, 1.0)
