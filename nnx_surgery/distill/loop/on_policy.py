"""On-policy distillation (GKD: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"): some steps train on the student's own continuations instead of the data's.

With probability `OnPolicyConfig.fraction` (GKD's lambda) per optimizer step, every row of the step's batch (all its
micro-batches) is replaced by its prompt followed by the student's continuation, sampled at `temperature` by the
`Sampler` given to `distill.run` (nnx_surgery/distill/interface.py). The replacement happens on the host, between fetching the
batch and dispatching the jitted step: sampling is not differentiated (the samples are data), and the step's code
is the same for both kinds of batch. Teacher and student then score prompt plus completion in the ordinary step,
with the stage's loss weights (GKD's JSD(beta) is the `jsd` weight with `DistillConfig.jsd_beta`).

Prompts. Rows keep their shape (batch_size, seq_len): the prompt area is `prompt_len` columns (default half the
row) and `max_new_tokens` (default the rest) are sampled. A row whose leading next-token targets are masked by its
`loss_mask` (a prompt/completion record of `TokenBatches`) takes that prompt, cut to `prompt_len` tokens; any other
row takes its first `prompt_len` tokens. Padding in the prompt area (attention_mask 0, or segment 0) is dropped;
the prompt is one context (a packed row's document boundaries inside it are not kept).

The new row is `prompt, completion, filler`: the completion is the sampler's tokens up to and including the first
stop (EOS), the filler (id 0) what follows. Its `loss_mask` weights exactly the predictions of the completion's
tokens (the prompt's and the filler's targets get 0), and it is explicit, so an EOS keeps its label even when the
pad id is the EOS id. `attention_mask` (1 on prompt and completion), `positions` (0, 1, ... along them) and
`segment_ids` (1 on them, 0 on the filler) are rewritten when the batch has those keys. When on-policy steps are on,
off-policy batches without a `loss_mask` get one of ones (the same weights), so both kinds of batch have the same
keys and the step compiles once.

The draw of each step comes from (seed, step) alone, as does the sampling key: a resumed or rolled-back run
redoes the same draws with no extra state in the checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Any, Callable

import jax
import numpy as np

from ...field_docs import documented
from ..interface import Sampler

DRAW_STREAM = 0x6B0D  # tags the numpy stream of the on-policy draws (seed, step, DRAW_STREAM)
KEY_STREAM = 0x5A3F  # tags the sampling keys


@dataclasses.dataclass(frozen=True)
class OnPolicyConfig:
    """On-policy distillation (module docstring): with probability `fraction` (GKD's lambda) per optimizer step the
    batch is the student's own continuations of its prompts, sampled at `temperature` (0: greedy) by the sampler
    given to `distill.run(..., sampler=)`; both models score prompt plus completion and the loss counts completion
    tokens only. `prompt_len`: the prompt area in tokens (None: half the row); `max_new_tokens`: tokens sampled
    (None: the rest of the row)."""

    fraction: float = documented(0.0, "on-policy distillation (GKD): the share of steps trained on the student's "
                                 "own continuations of the batch's prompts, scored by the teacher on the completion "
                                 "tokens (the student then learns from its own mistakes; each such step also "
                                 "samples)", flag="--on-policy", kind=float, metavar="LAMBDA")
    temperature: float = documented(1.0, "sampling temperature of the on-policy completions",
                                    flag="--on-policy-temperature", kind=float)
    prompt_len: int | None = documented(None, "prompt tokens kept per row before sampling",
                                        flag="--on-policy-prompt-len", kind=int,
                                        none_means="a record's prompt, else half the row")
    max_new_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.fraction, bool) or not (isinstance(self.fraction, numbers.Real)
                                                   and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"OnPolicyConfig: fraction={self.fraction!r} must lie in [0, 1] (the share of steps "
                             "trained on the student's own samples).")
        if not (isinstance(self.temperature, numbers.Real) and 0.0 <= self.temperature < math.inf):
            raise ValueError(f"OnPolicyConfig: temperature={self.temperature!r} must be a finite number >= 0 "
                             "(0 samples greedily).")
        for name in ("prompt_len", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"OnPolicyConfig: {name}={value!r} must be a positive number of tokens, or None.")

    def shape(self, seq_len: int) -> tuple[int, int]:
        """(prompt area, new tokens) for rows of `seq_len` tokens; ValueError when they do not fit in the row."""
        prompt = self.prompt_len or max(1, seq_len // 2)
        new = self.max_new_tokens or seq_len - prompt
        if new < 1 or prompt + new > seq_len:
            raise ValueError(f"on_policy: prompt_len {prompt} + max_new_tokens {new} must fit in rows of {seq_len} "
                             "tokens with at least one new token; lower them (or raise seq_len).")
        return prompt, new


def on_policy_at(seed: int, step: int, fraction: float) -> bool:
    """Whether optimizer step `step` (0-based) trains on the student's samples: a draw from (seed, step)."""
    if fraction <= 0.0:
        return False
    return bool(np.random.default_rng([int(seed), int(step), DRAW_STREAM]).random() < fraction)


def sampling_key(seed: int, step: int) -> jax.Array:
    """The PRNG key the sampler gets at step `step`."""
    return jax.random.fold_in(jax.random.key(np.uint32(int(seed) ^ KEY_STREAM)), int(step))


def _real(batch: dict[str, np.ndarray]) -> np.ndarray:
    """(B, T) bool: non-padding tokens (attention_mask, else segment_ids > 0, else all)."""
    if batch.get("attention_mask") is not None:
        return np.asarray(batch["attention_mask"]) > 0
    if batch.get("segment_ids") is not None:
        return np.asarray(batch["segment_ids"]) > 0
    return np.ones(np.shape(batch["input_ids"]), bool)


def prompt_areas(loss_mask: np.ndarray | None, rows: int, width: int) -> np.ndarray:
    """(B,) columns of each row that hold its prompt: the row's leading tokens whose next-token targets are masked
    (a prompt/completion record: tokens 0..t where t predicts the first supervised token), cut to `width`; `width`
    for rows whose first target is supervised (plain text) or that have none."""
    areas = np.full(rows, width, np.int64)
    if loss_mask is None:
        return areas
    supervised = np.asarray(loss_mask) > 0
    first = np.argmax(supervised, axis=1)
    has_prompt = supervised.any(axis=1) & (first >= 1)
    areas[has_prompt] = np.minimum(first[has_prompt] + 1, width)
    return areas


def prompts(batch: dict[str, np.ndarray], width: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(each row's prompt tokens, left-padded ids (B, width) int32, mask (B, width) int32). A row without any real
    prompt token gets a one-token prompt (its first id) so the sampler has a context; `completion_rows` gives
    such a row no weight."""
    ids, real = np.asarray(batch["input_ids"]), _real(batch)
    areas = prompt_areas(batch.get("loss_mask"), ids.shape[0], width)
    rows = [ids[b, :areas[b]][real[b, :areas[b]]] for b in range(ids.shape[0])]
    padded, mask = np.zeros((ids.shape[0], width), np.int32), np.zeros((ids.shape[0], width), np.int32)
    for b, row in enumerate(rows):
        context = row if len(row) else ids[b, :1]
        padded[b, width - len(context):], mask[b, width - len(context):] = context, 1
    return rows, padded, mask


def completion_rows(batch: dict[str, np.ndarray], prompt_rows: list[np.ndarray], tokens: np.ndarray,
                    valid: np.ndarray) -> dict[str, np.ndarray]:
    """The on-policy batch (module docstring): `prompt, completion, filler` rows with the batch's keys (plus
    `loss_mask`), the loss on the completion's tokens only. `tokens`, `valid` (B, N): the sampler's output; the
    completion is the leading run of valid tokens."""
    ids = np.asarray(batch["input_ids"])
    rows, length = ids.shape
    kept = np.cumprod(np.asarray(valid, bool), axis=1).sum(axis=1)
    out = {"input_ids": np.zeros_like(ids), "loss_mask": np.zeros((rows, length), np.float32)}
    for key in ("attention_mask", "positions", "segment_ids"):
        if batch.get(key) is not None:
            out[key] = np.zeros_like(np.asarray(batch[key]))
    for b in range(rows):
        prompt, n = prompt_rows[b], int(kept[b]) if len(prompt_rows[b]) else 0
        end = len(prompt) + n
        out["input_ids"][b, :end] = np.concatenate([prompt, np.asarray(tokens[b, :n], ids.dtype)])
        if n:  # the predictions at len(prompt) - 1 .. end - 2 of the completion's tokens (its EOS included)
            out["loss_mask"][b, len(prompt) - 1:end - 1] = 1.0
        if "attention_mask" in out:
            out["attention_mask"][b, :end] = 1
        if "segment_ids" in out:
            out["segment_ids"][b, :end] = 1
        if "positions" in out:
            out["positions"][b, :end] = np.arange(end)
    return out


class OnPolicy:
    """The training loop's on-policy part: the per-step draw, and the batch replacement when it says so."""

    def __init__(self, config: OnPolicyConfig, sampler: Sampler, seed: int):
        self.config, self.sampler, self.seed = config, sampler, int(seed)
        self.taken = self.drawn = 0

    def with_loss_mask(self, stacked: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A fetched (A, B, T) batch with a `loss_mask` (ones when it had none: the same weights), so off- and
        on-policy batches have the same keys and the step compiles once."""
        if "loss_mask" in stacked:
            return stacked
        return {**stacked, "loss_mask": np.ones(stacked["input_ids"].shape, np.float32)}

    def batch_for(self, stacked: dict[str, np.ndarray], step: int,
                  student: Callable[[], Any]) -> tuple[dict[str, np.ndarray] | None, dict[str, float]]:
        """(the on-policy batch, or None when step `step` keeps the data's; the step record's fields: `on_policy`
        1 or 0, `sample_s` the sampling time and `on_policy_rate` the share of this call's steps on-policy so far).
        `student()` gives the current student, called only when sampling."""
        self.drawn += 1
        if not on_policy_at(self.seed, step, self.config.fraction):
            return None, {"on_policy": 0, "sample_s": 0.0, "on_policy_rate": self.taken / self.drawn}
        started = time.perf_counter()
        accum, rows, length = stacked["input_ids"].shape
        flat = {key: value.reshape(accum * rows, length) for key, value in stacked.items()}
        width, new = self.config.shape(length)
        prompt_rows, ids, mask = prompts(flat, width)
        tokens, valid = self.sampler(student(), ids, mask, max_new_tokens=new, temperature=self.config.temperature,
                                     key=sampling_key(self.seed, step))
        tokens, valid = np.asarray(tokens), np.asarray(valid)
        if tokens.shape != (accum * rows, new) or valid.shape != tokens.shape:
            raise ValueError(f"the sampler returned tokens {tokens.shape} and valid {valid.shape}; expected "
                             f"{(accum * rows, new)} for both (see distill.interface.Sampler).")
        sampled = completion_rows(flat, prompt_rows, tokens, valid)
        self.taken += 1
        fields = {"on_policy": 1, "sample_s": time.perf_counter() - started, "on_policy_rate": self.taken / self.drawn}
        return {key: value.reshape(accum, rows, length) for key, value in sampled.items()}, fields

    def describe(self) -> str:
        c = self.config
        return (f"on-policy distillation: {c.fraction:g} of the steps train on the student's samples (temperature "
                f"{c.temperature:g}, prompt area {c.prompt_len or 'half the row'}, new tokens "
                f"{c.max_new_tokens or 'the rest of the row'})")


__all__ = ["OnPolicyConfig", "OnPolicy", "on_policy_at", "sampling_key", "prompt_areas", "prompts", "completion_rows"]
