"""`surgery.generate` and the KV cache against transformers' `generate` (greedy, token for token) and against
the model's own cache-free forward.

Tiny models of the three families have untied heads: with a tied head, random tiny models repeat one token
forever, which would make greedy parity trivial; each parity test checks the reference output is varied. The
real Gemma 3 270M test (slow) generates 64 tokens for prose and code prompts and for a prompt longer than its
512-token sliding window.
"""
from __future__ import annotations

import importlib
import numpy as np
import jax
import jax.numpy as jnp
import pytest
import torch
import transformers
from flax import nnx

from hf_reference import FAMILIES, make_hf_model, max_abs_diff, save_tiny_tokenizer
from nnx_surgery.surgery import load_pretrained
from nnx_surgery.surgery.modeling.model_config import SLIDING
from nnx_surgery.surgery.modeling.generation import generate

PROMPT_LENGTHS = (11, 4, 7)  # 11 > the tiny sliding window (5)
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (transformers model, our model, folder with a word-level tokenizer "t4".."t95")."""
    made = {}
    for seed, family in enumerate(FAMILIES):
        hf_model = make_hf_model(family, seed=seed, tie_word_embeddings=False)
        folder = str(tmp_path_factory.mktemp(family))
        hf_model.save_pretrained(folder)
        save_tiny_tokenizer(folder)
        made[family] = (hf_model, load_pretrained(folder), folder)
    return made


@nnx.jit
def _forward(model, ids, attention_mask=None, positions=None):
    return model(ids, attention_mask=attention_mask, positions=positions).logits


def logits(model, ids, attention_mask=None, positions=None) -> np.ndarray:
    """The cache-free forward, jitted (eager dispatch compiles every operation for every new shape)."""
    arrays = [None if a is None else jnp.asarray(a) for a in (ids, attention_mask, positions)]
    return np.asarray(_forward(model, *arrays))


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 96, n).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int, **kwargs) -> list[list[int]]:
    """transformers' greedy generate on left-padded prompts; each row's new tokens through its first eos."""
    width = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width), np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new_tokens,
                                do_sample=False, **kwargs)
    eos = hf_model.generation_config.eos_token_id
    return [_through(row, {eos} if isinstance(eos, int) else set(eos)) for row in out[:, width:].tolist()]


def _through(row: list[int], stops: set[int]) -> list[int]:
    hit = next((i for i, t in enumerate(row) if t in stops), None)
    return row if hit is None else row[:hit + 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_batched_and_alone(tiny, family):
    hf_model, model, _ = tiny[family]
    prompts = _prompts()
    want = hf_greedy(hf_model, prompts, NEW_TOKENS, pad_token_id=0)
    assert len({t for row in want for t in row}) >= 8  # varied output, several times the window
    got = generate(model, prompts, max_new_tokens=NEW_TOKENS)
    assert got.tokens == want
    assert got.prompt_lengths == list(PROMPT_LENGTHS) and got.padded_length == max(PROMPT_LENGTHS)
    assert got.decode_steps == max(map(len, want)) - 1 and got.prefill_s > 0 and got.decode_s > 0
    for prompt in prompts:  # unbatched: no padding at all; one max_len, so one compilation per prompt length
        alone = generate(model, [prompt], max_new_tokens=NEW_TOKENS, max_len=32)
        assert alone.tokens == hf_greedy(hf_model, [prompt], NEW_TOKENS, pad_token_id=0)


def test_cache_steps_match_the_cache_free_forward(tiny):
    """Prefill of a left-padded chunk longer than the window, a second chunk that wraps the ring buffers, then
    one-token steps: the logits equal one forward over the whole sequence."""
    _, model, _ = tiny["gemma3_text"]
    ids = np.random.default_rng(1).integers(4, 96, (2, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    want = logits(model, ids, mask, positions)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask, cache):
        out = nnx.merge(graphdef, state)(ids, attention_mask=mask, cache=cache)
        return out.logits, out.cache

    cache = model.init_cache(2, 20)
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == SLIDING]
    assert cache.keys[sliding[0]].shape[1] == model.config.sliding_window  # a ring of the window
    assert cache.keys[model.config.layer_types.index("full_attention")].shape[1] == 20
    got, cache = forward(state, jnp.asarray(ids[:, :8]), jnp.asarray(mask[:, :8]), cache)
    pieces = [np.asarray(got)]
    got, cache = forward(state, jnp.asarray(ids[:, 8:13]), jnp.ones((2, 5), jnp.int32), cache)
    pieces.append(np.asarray(got))
    for t in range(13, 16):
        got, cache = forward(state, jnp.asarray(ids[:, t:t + 1]), jnp.ones((2, 1), jnp.int32), cache)
        pieces.append(np.asarray(got))
    got = np.concatenate(pieces, axis=1)
    assert int(cache.end) == 16 and np.asarray(cache.next_position).tolist() == [13, 16]
    assert max_abs_diff(got[mask == 1], want[mask == 1]) <= 1e-5


def test_sampling_is_reproducible_and_top_k_one_is_greedy(tiny):
    _, model, _ = tiny["gemma2"]
    prompts = _prompts(seed=2)
    first = generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=7, stop=())
    assert generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=7, stop=()).tokens == first.tokens
    assert generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=8, stop=()).tokens != first.tokens
    greedy = generate(model, prompts, max_new_tokens=10, stop=())
    assert generate(model, prompts, max_new_tokens=10, temperature=0.7, top_k=1, seed=3, stop=()).tokens == \
        greedy.tokens
    assert first.tokens != greedy.tokens


def test_sampled_tokens_stay_in_the_top_k(tiny):
    """Every sampled token is among the k most likely after its own prefix (checked with a cache-free forward),
    and sampling does pick tokens other than the most likely."""
    _, model, _ = tiny["gemma3_text"]
    prompts, k = _prompts(seed=3), 3
    out = generate(model, prompts, max_new_tokens=12, temperature=2.0, top_k=k, seed=11, stop=())
    rows = np.zeros((len(prompts), 32), np.int32)  # right padding: causal logits of the tokens before it are exact
    for row, (prompt, new) in zip(rows, zip(prompts, out.tokens)):
        row[:len(prompt) + len(new)] = prompt + new
    everything, not_argmax = logits(model, rows), 0
    for row, (prompt, new) in zip(everything, zip(prompts, out.tokens)):
        scores = row[len(prompt) - 1:len(prompt) + len(new) - 1]
        ranks = (scores > scores[np.arange(len(new)), new][:, None]).sum(axis=1)
        assert ranks.max() < k
        not_argmax += int((ranks > 0).sum())
    assert not_argmax >= 3


def test_sampling_frequencies_follow_the_filtered_distribution(tiny):
    """512 draws of one first token: frequencies match softmax(logits / T) restricted to the top k (binomial
    tolerance), nothing outside it appears; top-p keeps exactly what transformers' TopPLogitsWarper keeps."""
    _, model, _ = tiny["gemma"]
    prompt, draws, temperature = _prompts(seed=4)[1], 512, 1.5
    scores = logits(model, [prompt])[0, -1] / temperature
    out = generate(model, [prompt] * draws, max_new_tokens=1, temperature=temperature, top_k=4, seed=0, stop=())
    counts = np.bincount([row[0] for row in out.tokens], minlength=len(scores))
    top = np.argsort(-scores)[:4]
    assert counts[np.setdiff1d(np.arange(len(scores)), top)].sum() == 0
    probs = np.exp(scores[top] - scores[top].max())
    probs /= probs.sum()
    sigma = np.sqrt(draws * probs * (1 - probs))
    assert np.all(np.abs(counts[top] - draws * probs) <= 4.5 * sigma + 1)

    nucleus = generate(model, [prompt] * draws, max_new_tokens=1, temperature=temperature, top_p=0.6, seed=1,
                       stop=())
    warped = transformers.TopPLogitsWarper(0.6)(None, torch.tensor(scores)[None])[0].numpy()
    kept = set(np.flatnonzero(np.isfinite(warped)).tolist())
    drawn = {row[0] for row in nucleus.tokens}
    assert drawn <= kept and len(kept) >= 2
    assert {t for t in kept if np.exp(scores[t] - np.logaddexp.reduce(scores)) > 0.03} <= drawn


def test_text_prompts_stop_ids_and_stop_strings(tiny):
    hf_model, model, folder = tiny["gemma2"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    texts = ["t5 t17 t33 t60 t8 t71 t40", "t90 t12"]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf_model.generate(**encoded, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    width = encoded["input_ids"].shape[1]
    want = ref[:, width:].tolist()
    got = generate(model, texts, max_new_tokens=8, tokenizer=folder, stop=())
    assert got.tokens == want and got.finish_reasons == ["length", "length"]
    assert got.texts == tokenizer.batch_decode(ref[:, width:], skip_special_tokens=True)

    row = want[0]
    stop_id = next(t for t in row[2:] if t not in row[:2])  # first seen at index >= 2
    by_id = generate(model, texts[:1], max_new_tokens=8, tokenizer=folder, stop=[stop_id])
    assert by_id.tokens == [row[:row.index(stop_id) + 1]] and by_id.finish_reasons == ["stop"]
    piece = tokenizer.decode([stop_id])
    by_string = generate(model, texts[:1], max_new_tokens=8, tokenizer=folder, stop=[" " + piece])
    assert by_string.tokens == [row[:row.index(stop_id) + 1]] and by_string.finish_reasons == ["stop_string"]
    assert by_string.texts[0].endswith(piece)


def test_a_one_character_stop_string_ends_rows_inside_the_decode_loop(tiny, monkeypatch):
    """One ASCII character cannot span two tokens: the tokens whose text holds it end their row inside the jitted
    loop (the text is never looked at), the loop ends with the last row's stop, and every row is the free run's
    tokens through the first token holding the character."""
    _, model, folder = tiny["gemma2"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["t5 t17 t33 t60 t8 t71 t40", "t90 t12", "t44 t9 t23", "t61"]
    free = generate(model, texts, max_new_tokens=NEW_TOKENS, tokenizer=folder, stop=())
    assert free.finish_reasons == ["length"] * len(texts)

    def through(row, char):
        hit = next((i for i, t in enumerate(row) if char in tokenizer.decode([t])), None)
        return None if hit is None else row[:hit + 1]

    chosen = [c for c in "0123456789" if all(through(r, c) for r in free.tokens)
              and max(len(through(r, c)) for r in free.tokens) < NEW_TOKENS]
    assert chosen, "no digit stops every row early; pick other prompts"
    module = importlib.import_module("nnx_surgery.surgery.modeling.generation")

    def never(*args):
        raise AssertionError("a one-character stop string needs no look at the text")

    monkeypatch.setattr(module, "_hits_stop_string", never)
    for char in chosen[:3]:
        want = [through(row, char) for row in free.tokens]
        got = generate(model, texts, max_new_tokens=NEW_TOKENS, tokenizer=folder, stop=[char])
        assert got.tokens == want and got.finish_reasons == ["stop_string"] * len(texts)
        assert got.decode_steps == max(map(len, want)) - 1  # not a step after the last row stopped
        assert all(text.endswith(tokenizer.decode([row[-1]])) and char in text for text, row in zip(got.texts, want))


def test_ids_showing_a_stop_string_are_every_id_whose_text_holds_it(tiny):
    from nnx_surgery.surgery.modeling.generation import TextCodec
    _, model, folder = tiny["gemma2"]
    codec = TextCodec.of(folder)
    size = model.config.vocab_size
    texts = [codec.decode([i]) for i in range(size)]
    for strings, whole in ((["7"], True), (["7", "t1"], False), ([" "], False), (["\u00e9"], False)):
        ids, complete = codec.ids_showing(strings, size)
        assert ids == tuple(i for i, text in enumerate(texts) if any(s in text for s in strings))
        assert complete == whole
    assert codec.ids_showing(["7"], size)[0] and codec.ids_showing(["7"], size) is codec.ids_showing(["7"], size)


def test_the_loop_ends_when_every_row_has_stopped(tiny):
    _, model, _ = tiny["gemma"]
    out = generate(model, _prompts(seed=5), max_new_tokens=NEW_TOKENS, stop=list(range(96)))
    assert out.decode_steps == 0 and all(len(row) == 1 for row in out.tokens)
    assert out.finish_reasons == ["stop"] * len(PROMPT_LENGTHS)


def test_fixed_shapes_give_the_same_tokens_and_compile_once(tiny):
    """pad_to / batch_rows: wider padding and filler rows change nothing in the returned rows, and prompts of other
    lengths at the same fixed shape reuse the compiled prefill."""
    _, model, folder = tiny["gemma"]
    prompts = _prompts(seed=7)[:2]
    plain = generate(model, prompts, max_new_tokens=6, stop=())
    fixed = generate(model, prompts, max_new_tokens=6, stop=(), pad_to=24, batch_rows=4)
    assert fixed.tokens == plain.tokens and fixed.padded_length == 24 and len(fixed.tokens) == 2
    module = importlib.import_module("nnx_surgery.surgery.modeling.generation")  # the package exports the function
    before = module._prefill._cache_size()
    generate(model, [p[:3] for p in prompts[:1]], max_new_tokens=6, stop=(), pad_to=24, batch_rows=4)
    assert module._prefill._cache_size() == before
    with pytest.raises(ValueError, match="pad_to"):
        generate(model, prompts, max_new_tokens=6, pad_to=1)
    with pytest.raises(ValueError, match="batch_rows"):
        generate(model, prompts, max_new_tokens=6, batch_rows=1)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(prompts=[[5, 6, 7, 8]], max_new_tokens=4, max_len=6), "max_len"),
    (dict(prompts=[[5, 6], []], max_new_tokens=4), "prompts[1]"),
    (dict(prompts=[], max_new_tokens=4), "prompts"),
    (dict(prompts=[[5, 6]], max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompts=[[5, 6]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[5, 6]], max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(prompts=[[5, 6]], max_new_tokens=4, top_k=0), "top_k"),
    (dict(prompts=["t5 t6"], max_new_tokens=4), "tokenizer"),
    (dict(prompts=[[5, 600]], max_new_tokens=4), "prompts[0]"),
])
def test_bad_arguments_raise_value_error_naming_them(tiny, kwargs, argument):
    _, model, _ = tiny["gemma"]
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        generate(model, **kwargs)


# ------------------------------------------------------------------------------------------------ real Gemma 3 270M
@pytest.fixture(scope="module")
def gemma_270m():
    from real_gemma import reference_folder

    folder = reference_folder()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf_model, load_pretrained(folder, dtype="float32")


def _stdlib_source_ids(tokenizer, count: int) -> list[int]:
    import inspect
    import textwrap

    ids = tokenizer(inspect.getsource(textwrap))["input_ids"]
    assert len(ids) > count
    return ids[:count]


@pytest.mark.slow
def test_real_gemma3_270m_greedy_matches_transformers(gemma_270m):
    """Prose and code prompts (text, through the folder's tokenizer) and 600 tokens of stdlib source (ids, longer
    than the 512-token sliding window) in one left-padded batch: 64 new tokens each, as transformers."""
    folder, hf_model, model = gemma_270m
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived"]
    long_prompt = _stdlib_source_ids(tokenizer, 600)
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    assert all(ids[0] == tokenizer.bos_token_id for ids in encoded + [long_prompt])
    want = hf_greedy(hf_model, encoded + [long_prompt], 64)
    got = generate(model, texts + [long_prompt], max_new_tokens=64, tokenizer=folder)
    assert got.prompt_lengths == [len(ids) for ids in encoded + [long_prompt]]  # BOS added as transformers does
    assert got.tokens == want
    assert min(map(len, want)) >= 16 and len(want[3]) == 64  # rows run on; the long one crosses the window
    assert got.texts == tokenizer.batch_decode(want, skip_special_tokens=True)
