"""Token batches: packing, masks, determinism, resume, held-out split, sources, and the byte tokenizer."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from nnx_surgery.distill.inputs.batches import (DataError, TokenBatches, load_tokenizer, read_records, stdlib_corpus,
                                                tokenize_records)
from nnx_surgery.distill.inputs.byte_tokenizer import (BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, byte_tokenizer,
                                                       save_byte_tokenizer)

EOS, BOS = 1, 2


def unique_docs(count: int, seed: int = 0, low: int = 3, high: int = 17) -> list[np.ndarray]:
    """Documents whose tokens are all distinct (ids from 10 up), so every token can be traced."""
    lengths = np.random.default_rng(seed).integers(low, high, count)
    starts = 10 + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, lengths)]


def epoch_rows(batches: TokenBatches) -> np.ndarray:
    """The rows of epoch 0, gathered from consecutive batches (the last batch may reach into epoch 1)."""
    rows = []
    while sum(len(r) for r in rows) < batches.num_rows:
        rows.append(batches.next_batch()["input_ids"])
    return np.concatenate(rows)[:batches.num_rows]


def stream(docs, bos=None) -> np.ndarray:
    return np.concatenate([np.concatenate([[bos] if bos is not None else [], d, [EOS]]) for d in docs])


def test_packing_loses_and_duplicates_no_token_within_an_epoch():
    docs = unique_docs(23)
    batches = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=8, batch_size=3, eval_fraction=0, seed=5)
    expected = stream(docs)
    assert batches.num_rows == len(expected) // 8  # the tail is dropped, no padding
    rows = epoch_rows(batches)
    assert sorted(map(tuple, rows)) == sorted(map(tuple, expected[:batches.num_rows * 8].reshape(-1, 8)))
    in_stream_order = rows[np.argsort(batches.order(0))]
    np.testing.assert_array_equal(in_stream_order.reshape(-1), expected[:batches.num_rows * 8])
    assert not np.array_equal(batches.order(0), np.arange(batches.num_rows))  # rows really are shuffled
    assert not np.array_equal(batches.order(0), batches.order(1))  # and reshuffled per epoch


def test_loss_mask_targets_next_token_and_skips_bos_prompt_and_padding():
    def encode(text: str) -> list[int]:
        return [10 + ord(ch) % 50 for ch in text]

    tok = load_tokenizer(encode, eos_id=EOS, bos_id=BOS, add_bos=True)
    records = ["hello world", ("Q: 2+2?", " A: 4"), "abc", ("prompt only then", " x")]
    docs = tokenize_records(records, tok)
    batches = TokenBatches(docs, seq_len=7, batch_size=2, eval_fraction=0, shuffle=False, drop_remainder=False)
    ids = np.concatenate([d[0] for d in docs])
    trainable = np.concatenate([d[1] for d in docs])
    n_rows = batches.num_rows
    assert n_rows == -(-len(ids) // 7)  # the tail row is padded, not dropped
    got_ids, got_mask = [], []
    for _ in range(-(-n_rows // 2)):
        batch = batches.next_batch()
        assert batch["input_ids"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
        got_ids.append(batch["input_ids"]), got_mask.append(batch["loss_mask"])
    got_ids, got_mask = np.concatenate(got_ids)[:n_rows], np.concatenate(got_mask)[:n_rows]
    padded = np.concatenate([ids, np.zeros(n_rows * 7 - len(ids), np.int32)]).reshape(n_rows, 7)
    weights = np.concatenate([trainable, np.zeros(n_rows * 7 - len(ids), bool)]).reshape(n_rows, 7)
    np.testing.assert_array_equal(got_ids, padded)
    assert (got_mask[:, -1] == 0).all()
    np.testing.assert_array_equal(got_mask[:, :-1], weights[:, 1:])
    # Spelled out: no prediction targets a BOS, a prompt token or padding; EOS is a target.
    targets, mask = got_ids[:, 1:], got_mask[:, :-1]
    assert (mask[targets == BOS] == 0).all() and (mask[targets == EOS] == 1).all()
    prompt_ids = set(encode("Q: 2+2?")) - set(encode(" A: 4hello worldabc x"))
    assert prompt_ids and all((mask[targets == t] == 0).all() for t in prompt_ids)
    assert (mask[:, len(ids) % 7 - 1:][-1] == 0).all()  # the padded tail of the last row


def test_same_seed_same_batches_other_seed_other_order():
    docs = unique_docs(40, seed=1)

    def run(seed):
        batches = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=6, batch_size=4, seed=seed)
        return [batches.next_batch()["input_ids"] for _ in range(2 * batches.num_rows // 4 + 1)]

    first, again, other = run(3), run(3), run(4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("steps_before", [3, 9])
def test_resume_mid_epoch_gives_the_same_following_batches(steps_before):
    docs = unique_docs(30, seed=2)
    kwargs = dict(eos_id=EOS, seq_len=5, batch_size=4, seed=11)
    batches = TokenBatches.from_arrays(docs, **kwargs)
    assert batches.num_rows % 4 != 0  # so some batch straddles an epoch boundary
    for _ in range(steps_before):
        batches.next_batch()
    state = json.loads(json.dumps(batches.state()))
    assert state["position"] != 0
    expected = [batches.next_batch() for _ in range(12)]
    assert batches.epoch >= 1

    resumed = TokenBatches.from_arrays(docs, **kwargs)
    resumed.restore(state)
    for want in expected:
        got = resumed.next_batch()
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])
    with pytest.raises(DataError, match="seed"):
        TokenBatches.from_arrays(docs, **{**kwargs, "seed": 12}).restore(state)
    with pytest.raises(DataError, match="num_rows|fingerprint"):
        TokenBatches.from_arrays(docs[1:], **kwargs).restore(state)


def test_held_out_documents_are_disjoint_from_training_and_deterministic():
    docs = unique_docs(50, seed=3)
    batches = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=8, batch_size=2, eval_fraction=0.1, seed=7,
                                       eval_batch_size=4)
    assert len(batches.eval_indices) == 5
    assert set(batches.eval_indices).isdisjoint(batches.train_indices)
    assert sorted(batches.eval_indices + batches.train_indices) == list(range(50))
    eval_tokens = set(np.concatenate([docs[i] for i in batches.eval_indices]).tolist())
    train_seen = set(epoch_rows(batches).reshape(-1).tolist()) - {EOS}
    assert train_seen and train_seen.isdisjoint(eval_tokens)
    evals = batches.eval_batches()
    assert all(b["input_ids"].shape == (4, 8) and b["loss_mask"].shape == (4, 8) for b in evals)
    eval_ids = np.concatenate([b["input_ids"] for b in evals]).reshape(-1)
    assert set(eval_ids.tolist()) - {EOS, PAD_ID} == eval_tokens  # every held-out token, nothing else
    mask = np.concatenate([b["loss_mask"] for b in evals]).reshape(-1)
    assert mask[-1] == 0 and (mask[np.flatnonzero(eval_ids == PAD_ID) - 1] == 0).all()
    again = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=8, batch_size=2, eval_fraction=0.1, seed=7)
    other = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=8, batch_size=2, eval_fraction=0.1, seed=8)
    assert again.eval_indices == batches.eval_indices != other.eval_indices


def test_batches_split_across_processes():
    docs = unique_docs(30, seed=4)
    kwargs = dict(eos_id=EOS, seq_len=6, batch_size=4, seed=1, eval_batch_size=2)
    whole = TokenBatches.from_arrays(docs, **kwargs)
    parts = [TokenBatches.from_arrays(docs, **kwargs, process_index=i, process_count=2) for i in range(2)]
    for _ in range(5):
        want = whole.next_batch()["input_ids"]
        got = [p.next_batch()["input_ids"] for p in parts]
        assert got[0].shape == (2, 6)
        np.testing.assert_array_equal(np.concatenate(got), want)
    eval_parts = [p.eval_batches() for p in parts]
    for i, want in enumerate(whole.eval_batches()):
        np.testing.assert_array_equal(np.concatenate([e[i]["input_ids"] for e in eval_parts]), want["input_ids"])
    with pytest.raises(DataError, match="split evenly"):
        TokenBatches.from_arrays(docs, **{**kwargs, "batch_size": 3}, process_count=2)


def test_segments_and_positions_follow_documents():
    docs = [np.arange(10, 13), np.arange(20, 22), np.arange(30, 35)]  # with EOS: lengths 4, 3, 6
    batches = TokenBatches.from_arrays(docs, eos_id=EOS, seq_len=5, batch_size=2, eval_fraction=0,
                                       shuffle=False, drop_remainder=False, return_segments=True)
    first = batches.next_batch()
    np.testing.assert_array_equal(first["segment_ids"], [[1, 1, 1, 1, 2], [1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(first["positions"], [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]])
    last = batches.next_batch()  # row 3 holds the tail and padding
    np.testing.assert_array_equal(last["segment_ids"][0], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(last["input_ids"][0], [33, 34, EOS, PAD_ID, PAD_ID])


def test_byte_tokenizer_round_trips_through_transformers(tmp_path):
    import transformers

    folder = save_byte_tokenizer(tmp_path / "tok")
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(folder))
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    assert len(hf) == VOCAB_SIZE == 260
    text = "def naïve(x):\n\treturn x ∘ 2  # ✓ \x00\x7f"
    ids = hf(text)["input_ids"]
    assert ids[0] == BOS_ID and ids[1:] == [4 + b for b in text.encode("utf-8")]
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert byte_tokenizer(folder).encode(text).ids == ids == byte_tokenizer().encode(text).ids
    # The data pipeline reads the same folder: BOS added (as the config says), EOS appended, and a literal
    # "<eos>" inside a document stays text instead of becoming a document boundary.
    tok = load_tokenizer(folder)
    assert (tok.eos_id, tok.bos_id, tok.add_bos, tok.pad_id) == (EOS_ID, BOS_ID, True, PAD_ID)
    assert tok.encode_batch(["a<eos>"])[0] == [4 + b for b in b"a<eos>"]
    from_hf = load_tokenizer(hf)
    assert (from_hf.eos_id, from_hf.bos_id, from_hf.add_bos) == (EOS_ID, BOS_ID, True)
    assert from_hf.encode_batch([text, "a<eos>"]) == tok.encode_batch([text, "a<eos>"])


def test_text_files_match_arrays_and_jsonl_prompts_are_masked(tmp_path):
    tok_dir = save_byte_tokenizer(tmp_path / "tok")
    texts = [f"document {i}: " + "x" * (i * 7 % 23) + "\n" for i in range(12)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_text(text)
    kwargs = dict(seq_len=16, batch_size=2, seed=9, eval_documents=2)
    from_files = TokenBatches.from_files(str(corpus), tok_dir, **kwargs)
    from_glob = TokenBatches.from_files(str(corpus / "*.txt"), tok_dir, **kwargs)
    arrays = [np.frombuffer(t.encode(), np.uint8).astype(np.int32) + 4 for t in texts]
    from_arrays = TokenBatches.from_arrays(arrays, eos_id=EOS_ID, bos_id=BOS_ID, **kwargs)
    for _ in range(4):
        want = from_arrays.next_batch()
        for other in (from_files, from_glob):
            got = other.next_batch()
            np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
            np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])

    rows = [{"prompt": "Q?", "completion": "A."}, {"prompt": "Why", "completion": " not"}]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_records(tmp_path / "pairs.jsonl", prompt_field="prompt", completion_field="completion") == \
        [("Q?", "A."), ("Why", " not")]
    pairs = TokenBatches.from_files(tmp_path / "pairs.jsonl", tok_dir, prompt_field="prompt",
                                    completion_field="completion", seq_len=4, batch_size=1, eval_fraction=0,
                                    shuffle=False)
    first = pairs.next_batch()  # [BOS, Q, ?, A]: only the prediction of "A" (from "?") counts
    np.testing.assert_array_equal(first["input_ids"][0], [BOS_ID, 4 + ord("Q"), 4 + ord("?"), 4 + ord("A")])
    np.testing.assert_array_equal(first["loss_mask"][0], [0, 0, 1, 0])
    with pytest.raises(DataError, match="no 'text' field"):
        TokenBatches.from_files(tmp_path / "pairs.jsonl", tok_dir, seq_len=4, batch_size=1)


def test_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no files"):
        TokenBatches.from_files(str(tmp_path / "missing" / "*.txt"), lambda s: [5], seq_len=4, batch_size=1)
    with pytest.raises(DataError, match="EOS"):
        load_tokenizer(lambda s: [5])
    with pytest.raises(DataError, match="fewer than batch_size"):
        TokenBatches.from_arrays([np.arange(5, 9)], eos_id=EOS, seq_len=4, batch_size=2, eval_fraction=0)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the package were not installed
    with pytest.raises(DataError, match=r"pip install 'nnx-surgery\[datasets\]'"):
        TokenBatches.from_hf_dataset("some/dataset", lambda s: [5], seq_len=4, batch_size=1)


def test_stdlib_corpus_is_sorted_bounded_and_deterministic():
    files = stdlib_corpus(max_bytes=200_000)
    assert files and files == sorted(files) and all(f.endswith(".py") for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 200_000
    assert not any(os.sep + "site-packages" + os.sep in f for f in files)
    assert stdlib_corpus(max_bytes=200_000) == files
    seeded = stdlib_corpus(max_bytes=200_000, seed=1)
    assert seeded == stdlib_corpus(max_bytes=200_000, seed=1) == sorted(seeded)
    assert seeded != stdlib_corpus(max_bytes=200_000, seed=2)
    assert set(files) <= set(stdlib_corpus())


def test_calibration_ids_are_seeded_training_rows_and_leave_the_stream_alone():
    from nnx_surgery.distill.inputs.batches import TokenBatches

    docs = [(np.arange(1, 50 + i, dtype=np.int32), np.ones(49 + i, bool)) for i in range(12)]
    data = TokenBatches(docs, seq_len=8, batch_size=2, seed=3, eval_documents=2)
    first = data.calibration_ids(5)
    assert first.shape == (5, 8) and first.dtype == np.int32
    assert np.array_equal(first, data.calibration_ids(5))
    assert not np.array_equal(first, data.calibration_ids(5, seed=4))
    rows = {tuple(r) for r in data._rows.tolist()}
    assert all(tuple(r) in rows for r in first.tolist())
    assert data.state()["position"] == 0
    assert len(data.calibration_ids(10_000)) == data.num_rows


def test_restart_rows_begin_continuations_with_the_restart_token():
    """restart_id: a row continuing a document starts with it (a segment start, never a target); a row starting a
    document gets a padding column; every corpus token still appears once, in order, with its own target flag."""
    docs = [(np.arange(100 + 1000 * i, 100 + 1000 * i + 7 + 3 * i, dtype=np.int32), np.ones(7 + 3 * i, bool))
            for i in range(12)]
    plain = TokenBatches(docs, seq_len=6, batch_size=2, seed=1, eval_documents=0, shuffle=False)
    restart = TokenBatches(docs, seq_len=6, batch_size=2, seed=1, eval_documents=0, shuffle=False, restart_id=2)
    rows = [restart.next_batch() for _ in range(restart.num_rows // 2)]
    ids = np.concatenate([b["input_ids"] for b in rows])
    starts = [d[0][0] for d in docs]
    for row, batch_row in zip(ids, [(b, r) for b in rows for r in range(2)]):
        batch, r = batch_row
        if row[1] in starts:  # a document starts the row: padding first, outside every segment
            assert row[0] == 0 and batch["segment_ids"][r, 0] == 0  # the step scores no target from it
        else:  # a continuation: the restart token at position 0, in the continuation's segment, not a target
            assert row[0] == 2 and batch["positions"][r, 0] == 0 and batch["positions"][r, 1] == 1
            assert batch["segment_ids"][r, 0] == batch["segment_ids"][r, 1] > 0 and batch["loss_mask"][r, 0] == 1
    corpus = np.concatenate([d[0] for d in docs])
    kept = ids[:, 1:].reshape(-1)
    assert (kept == corpus[:kept.size]).all()  # seq_len - 1 corpus tokens per row, in order
    assert restart.num_rows == len(corpus) // 5 and plain.num_rows == len(corpus) // 6
    with pytest.raises(DataError, match="restart_id"):
        TokenBatches(docs, seq_len=6, batch_size=2, restart_id=2, return_segments=False)
