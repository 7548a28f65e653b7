"""Text generation: `generate` for any `CausalLM`, over a preallocated KV cache (kv_cache.py): left-padded
batches, a jitted prefill and a jitted decode loop, greedy or sampled, stop ids and stop strings.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .causal_lm import CausalLM
from .kv_cache import KVCache

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]], np.ndarray]
Stop = Union[int, str, Sequence[Union[int, str]], None]
MAX_LEN_MULTIPLE = 128  # the default max_len is rounded up to this: other prompt lengths reuse the decode loop


# ------------------------------------------------------------------------------------------------ generate
@dataclasses.dataclass
class Generation:
    """What `generate` returns, per prompt in the order given.

    `tokens[i]`: the new token ids, up to and including the one that stopped the row (an eos / stop id, as
    transformers keeps it, or the token completing a stop string), without prompt or padding. `texts[i]`: those
    decoded without special tokens (None without a tokenizer). `finish_reasons[i]`: "stop" (a stop id),
    "stop_string" or "length". Timings (seconds, compilation included on a first call): `prefill_s` runs the
    padded prompts and picks each row's first token; `decode_s` the `decode_steps` one-token steps after it.
    """

    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    prompt_lengths: list[int]
    padded_length: int  # prompt length after left padding (every row's)
    decode_steps: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.tokens) * self.padded_length / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_steps else 0.0


def generate(model: CausalLM, prompts: Prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop: Stop = None,
             tokenizer: Any = None, max_len: int | None = None, pad_to: int | None = None,
             batch_rows: int | None = None) -> Generation:
    """Continue each prompt by up to `max_new_tokens` tokens with `model` (a `surgery.modeling.causal_lm.CausalLM` of any family).

    `prompts`: a list of strings (needs `tokenizer`: a `tokenizers.Tokenizer`, a transformers fast tokenizer, or
    a folder / tokenizer.json path; BOS is added as transformers' tokenizer adds it), a list of id lists, or a 2-D
    id array (one prompt per row, ids used as given). A single string or 1-D id list is one prompt. Prompts are
    left padded into one batch; `max_len` sizes the KV cache (default: longest prompt + `max_new_tokens`,
    rounded up to a multiple of 128 so that other prompt lengths reuse the compiled decode loop).

    `temperature` 0 is greedy (argmax); above 0 samples from softmax(logits / temperature) after `top_k`, then
    `top_p` (nucleus) filtering, in transformers' order; draws depend only on `seed` (and the batch).
    `stop`: token ids and/or strings that end a row; None means the model config's eos ids, `()` never stops
    early. Stop ids, and every token whose own text holds a stop string, end their row inside the jitted loop at
    every step; a stop string that can span tokens (longer than one ASCII character, or a space) is also looked
    for in the text on the host every 16 steps.

    Fixed shapes, so that many calls share one compilation (e.g. an evaluation harness's length buckets): `pad_to`
    left pads every prompt to that width (at least the longest prompt), `batch_rows` fills the batch up to that
    many rows with one-token filler rows, which are marked done after the prefill and never returned.
    """
    sampling = _check_sampling(max_new_tokens, temperature, top_k, top_p)
    text = None if tokenizer is None else TextCodec.of(tokenizer)
    rows = _prompt_rows(prompts, text, model.config.vocab_size)
    stop_ids, stop_strings = _stops(stop, model.config, text)
    # _stops refuses stop strings without a tokenizer: `text` is set whenever there are some
    string_ids, strings_in_tokens = (text.ids_showing(stop_strings, model.config.vocab_size)
                                     if stop_strings and text is not None else ((), True))
    count, width = len(rows), _fixed_width(rows, pad_to)
    pad_id = text.pad_id if text is not None else _config_id(model.config, "pad", 0)
    rows += [np.asarray([pad_id], np.int32)] * _filler_rows(count, batch_rows)
    if max_len is None:
        max_len = -(-(width + max_new_tokens) // MAX_LEN_MULTIPLE) * MAX_LEN_MULTIPLE
    max_len = int(max_len)
    if width + max_new_tokens > max_len:
        raise ValueError(f"max_len={max_len} is too small: the longest prompt has {width} tokens and "
                         f"max_new_tokens={max_new_tokens}; raise max_len to at least {width + max_new_tokens}.")
    ids, mask = _left_pad(rows, width, pad_id)
    graphdef, state = nnx.split(model)
    key, stops = jax.random.key(seed), _stop_mask([*stop_ids, *string_ids], model.config.vocab_size)
    started = time.perf_counter()
    carry = _prefill(graphdef, state, ids, mask, key, stops, temperature, top_p or 1.0, max_len=max_len,
                     max_new_tokens=max_new_tokens, sampling=sampling)
    if len(rows) > count:  # filler rows never keep the decode loop running
        carry = dataclasses.replace(carry, done=carry.done | (jnp.arange(len(rows)) >= count))
    jax.block_until_ready(carry)
    prefill_s, started = time.perf_counter() - started, time.perf_counter()
    checked = bool(stop_strings) and not strings_in_tokens  # a stop string may span tokens: look every 16 steps
    chunk = 16 if checked else max_new_tokens
    while int(carry.step) < max_new_tokens and not bool(np.all(np.asarray(carry.done))):
        limit = jnp.asarray(min(int(carry.step) + chunk, max_new_tokens), jnp.int32)
        carry = _decode(graphdef, state, carry, limit, key, stops, temperature, top_p or 1.0, sampling=sampling)
        if checked and text is not None:
            hits = _hits_stop_string(np.asarray(carry.tokens)[:, :int(carry.step)], text, stop_strings,
                                     np.asarray(carry.done))
            carry = dataclasses.replace(carry, done=carry.done | jnp.asarray(hits))
    tokens, steps = np.asarray(carry.tokens)[:count], int(carry.step)
    decode_s = time.perf_counter() - started
    kept, reasons = _finished_rows(tokens[:, :steps], stop_ids, stop_strings, text)
    texts = None if text is None else [text.decode(row) for row in kept]
    return Generation(tokens=kept, texts=texts, finish_reasons=reasons, prompt_lengths=[len(r) for r in rows[:count]],
                      padded_length=width, decode_steps=steps - 1, prefill_s=prefill_s, decode_s=decode_s)


def make_sampler(*, stop: Stop = None, top_k: int | None = None, top_p: float | None = None):
    """A sampler for on-policy distillation (`distill.interface.Sampler`, passed as `distill.run(..., sampler=)`):
    `sample(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, key) -> (tokens, valid)`.

    It runs `generate`'s jitted prefill and decode loop on left-padded (B, P) prompts with `key`, a cache of exactly
    P + max_new_tokens slots: the shapes are the same at every step of a run, so both compile once (the model's
    graph is a static argument; a module merged from the same graph hits the same compiled programs). `stop`: token
    ids ending a row (None: the model config's eos ids; strings are not supported here); `top_k` / `top_p` as in
    `generate`. Returns numpy `tokens` (B, max_new_tokens) int32 and `valid` (B, max_new_tokens) bool: True up to
    and including each row's first stop id; after it, and for steps never run (every row had stopped), False."""
    if isinstance(stop, str) or (isinstance(stop, (list, tuple)) and any(isinstance(s, str) for s in stop)):
        raise ValueError(f"make_sampler: stop={stop!r} has strings; on-policy sampling stops on token ids only.")

    def sample(model: CausalLM, prompt_ids, prompt_mask, *, max_new_tokens: int, temperature: float,
               key: jax.Array) -> tuple[np.ndarray, np.ndarray]:
        sampling = _check_sampling(max_new_tokens, temperature, top_k, top_p)
        stop_ids = _stops(stop, model.config, None)[0]
        stops = _stop_mask(stop_ids, model.config.vocab_size)
        ids, mask = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32)
        graphdef, state = nnx.split(model)
        carry = _prefill(graphdef, state, ids, mask, key, stops, temperature, top_p or 1.0,
                         max_len=ids.shape[1] + max_new_tokens, max_new_tokens=max_new_tokens, sampling=sampling)
        if max_new_tokens > 1:
            carry = _decode(graphdef, state, carry, jnp.asarray(max_new_tokens, jnp.int32), key, stops, temperature,
                            top_p or 1.0, sampling=sampling)
        tokens, steps = np.asarray(carry.tokens), int(carry.step)
        return tokens, completion_mask(tokens, steps, stop_ids)

    return sample


def completion_mask(tokens: np.ndarray, steps: int, stop_ids: Sequence[int]) -> np.ndarray:
    """(B, N) bool: the tokens each row chose up to and including its first stop id, among the first `steps`."""
    stopped = np.isin(tokens, np.asarray(list(stop_ids), np.int64)) if stop_ids else np.zeros(tokens.shape, bool)
    before = np.cumsum(stopped, axis=1) - stopped  # stops strictly before each column
    return (before == 0) & (np.arange(tokens.shape[1]) < steps)


class _Sampling(NamedTuple):
    """The static part of the sampling settings (temperature and top_p values are traced: no recompilation)."""

    greedy: bool
    top_k: int | None
    nucleus: bool


@dataclasses.dataclass
class _Carry:
    cache: KVCache
    tokens: jax.Array  # (B, max_new_tokens) int32, chosen tokens (filler after a row stopped)
    done: jax.Array  # (B,) bool
    step: jax.Array  # () int32, tokens chosen so far


jax.tree_util.register_dataclass(_Carry, data_fields=["cache", "tokens", "done", "step"], meta_fields=[])


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "max_new_tokens", "sampling"))
def _prefill(graphdef, state, ids, mask, key, stops, temperature, top_p, *, max_len: int, max_new_tokens: int,
             sampling: _Sampling) -> _Carry:
    """The padded prompts through an empty cache; logits of the last column only (left padding puts every row's
    last prompt token there), and the first new token."""
    model = nnx.merge(graphdef, state)
    out = model(ids, attention_mask=mask, cache=model.init_cache(ids.shape[0], max_len), return_logits=False)
    token = _choose(model.logits_from_hidden(out.final_hidden[:, -1]), jax.random.fold_in(key, 0), temperature,
                    top_p, sampling)
    tokens = jnp.zeros((ids.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(token)
    return _Carry(out.cache, tokens, stops[token], jnp.ones((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("carry",))
def _decode(graphdef, state, carry: _Carry, limit, key, stops, temperature, top_p, *, sampling: _Sampling) -> _Carry:
    """One-token steps until `limit` tokens are chosen or every row has stopped (the cache is updated in place)."""
    model = nnx.merge(graphdef, state)

    def step(c: _Carry) -> _Carry:
        last = jax.lax.dynamic_slice_in_dim(c.tokens, c.step - 1, 1, axis=1)
        out = model(last, cache=c.cache, return_logits=False)
        token = _choose(model.logits_from_hidden(out.final_hidden[:, 0]), jax.random.fold_in(key, c.step),
                        temperature, top_p, sampling)
        token = jnp.where(c.done, 0, token)
        tokens = jax.lax.dynamic_update_slice_in_dim(c.tokens, token[:, None], c.step, axis=1)
        return _Carry(out.cache, tokens, c.done | stops[token], c.step + 1)

    return jax.lax.while_loop(lambda c: (c.step < limit) & ~jnp.all(c.done), step, carry)


def _choose(logits: jax.Array, key, temperature, top_p, sampling: _Sampling) -> jax.Array:
    """(B, V) float32 logits -> (B,) token ids: argmax, or a draw after temperature, top-k, then top-p (nucleus:
    drop the least likely tokens whose probabilities sum to at most 1 - top_p, keeping at least one), as
    transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper do."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if sampling.top_k is None and not sampling.nucleus:
        return jax.random.categorical(key, logits).astype(jnp.int32)
    values, indices = jax.lax.top_k(logits, min(sampling.top_k or logits.shape[-1], logits.shape[-1]))
    if sampling.nucleus:  # values are sorted descending; transformers accumulates from the least likely
        ascending = jnp.cumsum(jax.nn.softmax(values[:, ::-1], axis=-1), axis=-1)
        removed = (ascending <= 1.0 - top_p).at[:, -1].set(False)[:, ::-1]
        values = jnp.where(removed, -jnp.inf, values)
    choice = jax.random.categorical(key, values)
    return jnp.take_along_axis(indices, choice[:, None], axis=1)[:, 0].astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ host side
def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> _Sampling:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer.")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy decoding).")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive integer or None.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] or None.")
    nucleus = top_p is not None and top_p < 1
    return _Sampling(greedy=temperature == 0, top_k=None if top_k is None else int(top_k), nucleus=nucleus)


def _fixed_width(rows: list[np.ndarray], pad_to: int | None) -> int:
    width = max(len(r) for r in rows)
    if pad_to is not None and int(pad_to) < width:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({width} tokens); give at least {width}.")
    return width if pad_to is None else int(pad_to)


def _filler_rows(count: int, batch_rows: int | None) -> int:
    if batch_rows is not None and int(batch_rows) < count:
        raise ValueError(f"batch_rows={batch_rows} is fewer than the {count} prompts; give at least {count}.")
    return 0 if batch_rows is None else int(batch_rows) - count


class TextCodec:
    """Text <-> ids with a `tokenizers.Tokenizer`: BOS as transformers adds it, special tokens skipped on output."""

    def __init__(self, tokenizer, config: dict):
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id, pad = (self._id(config.get(f"{name}_token"), f"<{name}>")
                                         for name in ("bos", "eos", "pad"))
        self.pad_id = 0 if pad is None else pad
        self.add_bos = bool(config.get("add_bos_token")) and self.bos_id is not None
        self._showing: dict = {}  # ids_showing's answers

    @classmethod
    def of(cls, tokenizer) -> "TextCodec":
        """A codec for a folder / tokenizer.json path, a `tokenizers.Tokenizer` or a transformers fast tokenizer
        (a codec is returned as it is)."""
        if isinstance(tokenizer, TextCodec):
            return tokenizer
        if isinstance(tokenizer, (str, os.PathLike)):
            path = os.fspath(tokenizer)
            file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
            if not os.path.isfile(file):
                raise ValueError(f"tokenizer={path!r}: no tokenizer.json there; pass a Hugging Face model folder, "
                                 "a tokenizer.json file or a tokenizers.Tokenizer.")
            config: dict = {}
            for name in ("special_tokens_map.json", "tokenizer_config.json"):
                candidate = os.path.join(os.path.dirname(file), name)
                if os.path.isfile(candidate):
                    with open(candidate) as f:
                        config.update(json.load(f))
            from tokenizers import Tokenizer
            return cls(Tokenizer.from_file(file), config)
        if getattr(tokenizer, "backend_tokenizer", None) is not None:  # a transformers fast tokenizer
            names = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
            return cls(tokenizer.backend_tokenizer, names)
        if all(hasattr(tokenizer, a) for a in ("encode", "decode", "token_to_id")):
            return cls(tokenizer, {})
        raise ValueError(f"tokenizer={type(tokenizer).__name__} is not usable; pass a tokenizers.Tokenizer, a "
                         "transformers fast tokenizer, or a folder / tokenizer.json path.")

    def _id(self, entry, fallback: str) -> int | None:
        name = entry.get("content") if isinstance(entry, dict) else entry
        return self.tokenizer.token_to_id(name or fallback)

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:  # add_bos comes with a bos_id
            return [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def ids_showing(self, strings: Sequence[str], vocab_size: int) -> tuple[tuple[int, ...], bool]:
        """(the ids below `vocab_size` whose own text holds one of `strings`, whether every occurrence of the
        strings must lie inside one token). Such a token completes a stop string wherever it comes (a token's
        text in context holds its text alone: decoders strip only a leading space at the very start), so the
        decode loop stops its row at once, without looking at the text. When each string is one ASCII character
        other than a space, no occurrence can span two tokens, and the ids are the whole answer (no look at the
        text is needed at all). Computed once per codec and strings."""
        key = (tuple(strings), int(vocab_size))
        if key not in self._showing:
            counted = getattr(self.tokenizer, "get_vocab_size", None)
            size = int(vocab_size) if counted is None else min(int(vocab_size), counted(with_added_tokens=True))
            pieces = [[i] for i in range(size)]
            batch = getattr(self.tokenizer, "decode_batch", None)
            texts = (batch(pieces, skip_special_tokens=True) if batch is not None
                     else [self.tokenizer.decode(p, skip_special_tokens=True) for p in pieces])
            usable = [s for s in strings if "\ufffd" not in s]
            ids = tuple(i for i, piece in enumerate(texts) if any(s in piece for s in usable))
            whole = all(len(s) == 1 and s.isascii() and s != " " for s in strings)
            self._showing[key] = (ids, whole)
        return self._showing[key]


def _prompt_rows(prompts, text: TextCodec | None, vocab_size: int) -> list[np.ndarray]:
    if isinstance(prompts, str) or (isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 1):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
        prompts = [prompts]
    elif isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) != 2:
        raise ValueError(f"prompts: an id array must be 1-D or 2-D (B, T), got shape {np.shape(prompts)}.")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one string or list of token ids.")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if text is None:
                raise ValueError("prompts are strings but tokenizer=None; pass tokenizer= (a tokenizers.Tokenizer "
                                 "or the model's folder) or token ids.")
            prompt = text.encode(prompt)
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompts[{i}] must be a string or a 1-D list of token ids, got {ids.dtype} {ids.shape}.")
        if ids.size == 0:
            raise ValueError(f"prompts[{i}] is empty (no tokens); every prompt needs at least one token.")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}), the model's vocabulary.")
        rows.append(ids.astype(np.int32))
    return rows


def _left_pad(rows: list[np.ndarray], width: int, pad_id: int) -> tuple[jax.Array, jax.Array]:
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return jnp.asarray(ids), jnp.asarray(mask)


def _config_id(config, name: str, default):
    value = config.raw.get(f"{name}_token_id")
    return default if value is None else value


def _stops(stop, config, text: TextCodec | None) -> tuple[list[int], list[str]]:
    if stop is None:
        eos = _config_id(config, "eos", None if text is None else text.eos_id)
        return ([] if eos is None else [int(e) for e in np.atleast_1d(eos)]), []
    items = [stop] if isinstance(stop, (str, int, np.integer)) else list(stop)
    strings = [s for s in items if isinstance(s, str)]
    ids = [int(s) for s in items if not isinstance(s, str)]
    if strings and text is None:
        raise ValueError(f"stop={strings!r} has strings but tokenizer=None; pass tokenizer= to use stop strings.")
    if any(not s for s in strings):
        raise ValueError("stop contains an empty string; stop strings must have at least one character.")
    return ids, strings


def _stop_mask(ids, vocab_size: int) -> jax.Array:
    """(vocab_size,) bool: True at the ids that end a row. A mask of the vocabulary's width, not a list of ids,
    so any set of stops runs the same compiled prefill and decode loop."""
    mask = np.zeros(vocab_size, bool)
    mask[[i for i in ids if 0 <= i < vocab_size]] = True
    return jnp.asarray(mask)


def _hits_stop_string(tokens: np.ndarray, text: TextCodec, strings: list[str], done: np.ndarray) -> np.ndarray:
    return np.array([not d and any(s in text.decode(row) for s in strings) for row, d in zip(tokens, done)])


def _finished_rows(tokens: np.ndarray, stop_ids, strings, text) -> tuple[list[list[int]], list[str]]:
    """Each row's tokens through its stop: the first stop id, or the end of the shortest prefix holding a stop
    string, whichever comes first (a row may run on past a stop string until the next look at the text; what
    follows it is dropped here)."""
    kept, reasons = [], []
    for row in tokens.tolist():
        hit = next((i for i, t in enumerate(row) if t in stop_ids), None)
        upto = row if hit is None else row[:hit]  # a stop id ends its row, whatever its own text holds
        by_string = bool(strings) and any(s in text.decode(upto) for s in strings)
        if by_string:
            hit = next(n for n in range(1, len(upto) + 1) if any(s in text.decode(upto[:n]) for s in strings)) - 1
        kept.append(row if hit is None else row[:hit + 1])
        reasons.append("length" if hit is None else "stop_string" if by_string else "stop")
    return kept, reasons


__all__ = ["KVCache", "Generation", "generate", "make_sampler", "completion_mask", "TextCodec"]
