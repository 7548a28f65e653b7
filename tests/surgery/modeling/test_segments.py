"""Packed documents (`segment_ids`) against the definition: every document of a packed row gets the logits it
gets when run alone, for all three families, with documents longer than the sliding window (5 in the tiny
Gemma 2 / 3 configs) and padding at the end of a row."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_surgery.distill.inputs.batches import TokenBatches
from hf_reference import FAMILIES, make_hf_model, max_abs_diff
from nnx_surgery.surgery import load_pretrained
from nnx_surgery.surgery.modeling.causal_lm import segment_positions

TOL = 1e-5
# Per row: document lengths, then padding. 9 and 12 are longer than the window, 1 is a lone token.
ROWS = ([7, 3, 9, 1], [12, 6, 2])
LENGTH = 24


@nnx.jit
def _forward(model, ids, positions=None, segment_ids=None):
    return model(ids, positions=positions, segment_ids=segment_ids)


def logits(model, ids, positions=None, segment_ids=None) -> np.ndarray:
    """Jitted (one compilation per shape instead of one per operation and shape)."""
    arrays = [None if a is None else jnp.asarray(a) for a in (ids, positions, segment_ids)]
    return np.asarray(_forward(model, *arrays).logits)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = {}
    for seed, family in enumerate(FAMILIES):
        folder = str(tmp_path_factory.mktemp(family))
        make_hf_model(family, seed=seed).save_pretrained(folder)
        loaded[family] = load_pretrained(folder)
    return loaded


def _packed(seed: int = 0):
    """ids, positions, segment_ids (B, LENGTH) and each row's documents as id arrays."""
    rng = np.random.default_rng(seed)
    ids, positions, segments = (np.zeros((len(ROWS), LENGTH), np.int32) for _ in range(3))
    documents = []
    for row, lengths in enumerate(ROWS):
        start, docs = 0, []
        for number, length in enumerate(lengths, start=1):
            doc = rng.integers(4, 96, length).astype(np.int32)
            ids[row, start:start + length] = doc
            positions[row, start:start + length] = np.arange(length)
            segments[row, start:start + length] = number
            docs.append((start, doc))
            start += length
        documents.append(docs)
    return ids, positions, segments, documents


def _alone(model, docs: list[np.ndarray]) -> list[np.ndarray]:
    """Each document's logits run on its own: one row per document, from position 0, with trailing padding that
    causal attention never reaches (one forward instead of one per length)."""
    rows = np.zeros((len(docs), LENGTH), np.int32)
    for i, doc in enumerate(docs):
        rows[i, :len(doc)] = doc
    out = logits(model, rows)
    return [out[i, :len(doc)] for i, doc in enumerate(docs)]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_match_each_document_alone(models, family):
    model = models[family]
    ids, positions, segments, documents = _packed()
    packed = logits(model, ids, positions, segments)
    plain = logits(model, ids)
    located = [(row, start, doc) for row, docs in enumerate(documents) for start, doc in docs]
    alone = _alone(model, [doc for _, _, doc in located])
    for (row, start, doc), want in zip(located, alone):
        assert max_abs_diff(packed[row, start:start + len(doc)], want) <= TOL
        if start:  # without segments, a later document sees the earlier ones: the test can tell
            assert max_abs_diff(plain[row, start:start + len(doc)], want) > 100 * TOL
    longest = max(located, key=lambda entry: len(entry[2]))  # and one truly alone, unpadded
    exact = logits(model, longest[2][None])[0]
    assert max_abs_diff(packed[longest[0], longest[1]:longest[1] + len(longest[2])], exact) <= TOL


def test_positions_default_to_restarting_per_segment(models):
    model = models["gemma3_text"]
    ids, positions, segments, _ = _packed(seed=1)
    np.testing.assert_array_equal(np.asarray(segment_positions(jnp.asarray(segments)))[segments > 0],
                                  positions[segments > 0])
    given = logits(model, ids, positions, segments)
    derived = logits(model, ids, None, segments)
    valid = segments > 0
    assert max_abs_diff(given[valid], derived[valid]) == 0.0


def test_attention_never_crosses_documents(models):
    model = models["gemma2"]
    ids, positions, segments, _ = _packed(seed=2)
    out = model(jnp.asarray(ids), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments),
                capture=("attention_probs",))
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    for probs in out.attention_probs:  # (B, N, T, S)
        leaked = np.where(same[:, None], 0.0, np.asarray(probs))
        assert np.abs(leaked[np.broadcast_to(segments[:, None, :, None] > 0, leaked.shape)]).max() == 0.0


def test_token_batches_segments_drive_the_model(models):
    """The batches distillation packs (`TokenBatches(return_segments=True)`) give each document its own logits."""
    model = models["gemma"]
    rng = np.random.default_rng(3)
    docs = [rng.integers(4, 96, n).astype(np.int32) for n in (5, 9, 3, 8)]
    batches = TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=2, shuffle=False,
                                       eval_fraction=0.0, drop_remainder=False, return_segments=True)
    batch = batches.next_batch()
    packed = logits(model, batch["input_ids"], batch["positions"], batch["segment_ids"])
    located = []
    for row in range(len(packed)):
        segments = batch["segment_ids"][row]
        for segment in sorted(set(segments.tolist()) - {0}):
            located.append((row, np.flatnonzero(segments == segment)))
    for (row, where), want in zip(located, _alone(model, [batch["input_ids"][r, w] for r, w in located])):
        assert batch["positions"][row, where[0]] == 0
        assert max_abs_diff(packed[row, where], want) <= TOL
    assert len(located) >= 4  # several documents, some continuing from the previous row
