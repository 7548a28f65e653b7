"""Held-out sets a student is judged on, scored passage by passage so that differences get confidence intervals.

    general = HeldoutSet.from_texts("general", distill.general_prose("heldout"), folder, seq_len=256,
                                    max_tokens=32768)
    scores = score_heldout({"teacher": t, "distilled": s, "control": c}, general, reference="teacher")
    summary = summarise(scores["distilled"], general)           # ce, ce_per_byte, kl, top1_agreement, ...
    low, high = paired_interval(scores["distilled"], scores["control"], general, "ce")[1:]

A `HeldoutSet` is text cut into passages of whole lines, one passage per row (a start token, then the passage's
tokens, right padding), each passage remembering the document it came from and its UTF-8 byte count. Scoring a
model against a reference (the teacher) gives per passage: the summed negative log-likelihood of its tokens under
the model and under the reference, the summed KL(reference || model), the number of top-1 agreements and of
scored tokens. From those: cross-entropy per token, per byte of text (fair between models whose tokenizers differ),
KL and agreement, and a paired bootstrap over documents for the difference of two models on the same passages
(passages of one document are not independent, documents are closer to it).

The reference's final hidden states are computed once per batch and reused for every model, and no (rows, V)
logits exist (the vocabulary is walked in blocks, `evaluate._online_compare`). Rows are the same on every
process, so a multi-host run gets the same numbers on every process.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.distill.inputs.batches import DataError, TextTokenizer, load_tokenizer
from nnx_surgery.distill.distributed import say, to_host
from nnx_surgery.evaluation.perplexity import _online_compare, model_mesh, same_on_every_process
from nnx_surgery.distill.interface import forward_inputs, next_token_targets
from nnx_surgery.distill.losses.divergence import row_blocks

SCORE_KEYS = ("nll", "ref_nll", "kl", "agree", "tokens")


@dataclasses.dataclass(frozen=True)
class HeldoutSet:
    """Passages of held-out text as rows. `rows` (N, T) int32 token ids (a start token, then the passage);
    `loss_mask` (N, T) float32 (1 where position t's prediction of token t + 1 is scored: every passage token);
    `documents` (N,) the document each passage came from; `passage_bytes` (N,) UTF-8 bytes of its text."""
    name: str
    rows: np.ndarray
    loss_mask: np.ndarray
    documents: np.ndarray
    passage_bytes: np.ndarray
    description: str = ""
    texts: tuple[str, ...] = ()  # each passage's text (from_texts keeps them: `retokenised` needs them)

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def bytes(self) -> int:
        return int(self.passage_bytes.sum())

    @property
    def num_documents(self) -> int:
        return len(np.unique(self.documents))

    @classmethod
    def from_texts(cls, name: str, texts: Sequence[str], tokenizer: Any, *, seq_len: int,
                   max_tokens: int | None = None, seed: int = 0, description: str = "",
                   min_documents: int = 16) -> "HeldoutSet":
        """Documents `texts` in an order drawn from `seed`, each cut into passages of whole lines of at most
        `seq_len - 1` tokens (a longer line is cut between characters), until `max_tokens` scored tokens (whole
        passages; all of the text without it). With `max_tokens`, a document gives at most its share of
        `min_documents` (passages drawn from `seed`, in order), so the set spans that many documents when the
        texts have them: intervals come from documents, and one long document would be a set of one. The start
        token is BOS when the tokenizer adds one, else EOS (the separator such a tokenizer's documents follow)."""
        if seq_len < 4:
            raise DataError(f"HeldoutSet {name!r}: seq_len {seq_len} is too short for a passage; use >= 4.")
        tok = load_tokenizer(tokenizer)
        start = tok.bos_id if tok.add_bos and tok.bos_id is not None else tok.eos_id
        passages: list[tuple[int, list[int], int, str]] = []  # (document, ids, bytes, text)
        total = 0
        rng = np.random.default_rng([seed, 0x6E7])
        share = None if max_tokens is None else max(1, -(-max_tokens // min(min_documents, len(texts) or 1)))
        for document in rng.permutation(len(texts)).tolist():
            found = list(_passages(texts[document], tok, seq_len - 1))
            if share is not None:
                keep, count = [], 0
                for index in rng.permutation(len(found)).tolist():
                    if count >= share:
                        break
                    keep.append(index)
                    count += len(found[index][1])
                found = [found[i] for i in sorted(keep)]
            for text, ids in found:
                passages.append((document, ids, len(text.encode("utf-8")), text))
                total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None:  # whole passages up to the budget (the last document may be cut)
            kept, count = [], 0
            for passage in passages:
                if count >= max_tokens:
                    break
                kept.append(passage)
                count += len(passage[1])
            passages = kept
        if not passages:
            raise DataError(f"HeldoutSet {name!r}: the texts give no passage with a token; pass non-empty text.")
        rows = np.full((len(passages), seq_len), tok.pad_id, np.int32)
        mask = np.zeros((len(passages), seq_len), np.float32)
        for r, (_, ids, _, _) in enumerate(passages):
            rows[r, 0], rows[r, 1:len(ids) + 1] = start, ids
            mask[r, :len(ids)] = 1.0
        return cls(name, rows, mask, np.asarray([p[0] for p in passages]), np.asarray([p[2] for p in passages]),
                   description, tuple(p[3] for p in passages))

    def retokenised(self, tokenizer: Any) -> "HeldoutSet":
        """The same passages (texts, documents, bytes) in another tokenizer's tokens, e.g. a student's with a
        trimmed vocabulary: passage i of both sets is the same text, so per-byte scores pair passage by passage.
        Rows are as long as the longest passage needs (a trimmed tokenizer may spell a passage in more tokens)."""
        if len(self.texts) != len(self.rows):
            raise DataError(f"HeldoutSet {self.name!r} has no passage texts to tokenise again; build it with "
                            "HeldoutSet.from_texts.")
        tok = load_tokenizer(tokenizer)
        start = tok.bos_id if tok.add_bos and tok.bos_id is not None else tok.eos_id
        encoded = [list(ids) for ids in tok.encode_batch(list(self.texts))]
        width = max(self.rows.shape[1], -(-(max(len(ids) for ids in encoded) + 1) // 8) * 8)
        rows = np.full((len(encoded), width), tok.pad_id, np.int32)
        mask = np.zeros((len(encoded), width), np.float32)
        for r, ids in enumerate(encoded):
            rows[r, 0], rows[r, 1:len(ids) + 1] = start, ids
            mask[r, :len(ids)] = 1.0
        return dataclasses.replace(self, rows=rows, loss_mask=mask)


def _passages(text: str, tok: TextTokenizer, limit: int):
    """(passage text, its token ids) for runs of whole lines of `text` of at most `limit` tokens each."""
    lines = [piece for line in text.splitlines(keepends=True) for piece in _fit(line, tok, limit)]
    counts = [len(ids) for ids in tok.encode_batch(lines)] if lines else []
    begin = 0
    while begin < len(lines):
        end, total = begin, 0
        while end < len(lines) and total + counts[end] <= limit:
            total, end = total + counts[end], end + 1
        end = max(end, begin + 1)
        while True:  # per-line counts estimate the joined text's: the joined text is what counts
            chunk = "".join(lines[begin:end])
            ids = list(tok.encode_batch([chunk])[0])
            if len(ids) <= limit or end == begin + 1:
                break
            end -= 1
        if ids:
            yield chunk, ids[:limit]
        begin = end


def _fit(line: str, tok: TextTokenizer, limit: int) -> list[str]:
    """`line`, or pieces of it of at most `limit` tokens each when it is longer (cut between characters)."""
    if len(tok.encode_batch([line])[0]) <= limit:
        return [line]
    half = len(line) // 2
    return _fit(line[:half], tok, limit) + _fit(line[half:], tok, limit)


# ------------------------------------------------------------------------------------------------ scoring
def _row_scores(model, reference, batch, ref_hidden, vocab_chunk: int, row_chunk: int,
                hidden: jax.Array | None = None) -> dict[str, jax.Array]:
    """Per row of a (B, T) batch: summed NLL under the model and the reference, summed KL(reference || model),
    top-1 agreements and scored tokens. `hidden`: the model's final hidden states when known (the reference
    scored alone: its own), else computed here."""
    labels, weights, _ = next_token_targets(batch)
    if hidden is None:
        hidden = model(batch["input_ids"], **forward_inputs(model, batch), return_logits=False).final_hidden
    flat = [h.reshape(-1, h.shape[-1]) for h in (hidden, ref_hidden)]
    targets = row_blocks(labels.reshape(-1), row_chunk)
    if model is reference:  # the reference scored alone: one block array, so XLA computes its logits once
        per = jax.lax.map(lambda b: _online_compare(model, reference, b[0], b[0], vocab_chunk, targets=b[1]),
                          (row_blocks(flat[0], row_chunk), targets))
    else:
        blocks = (row_blocks(flat[0], row_chunk), row_blocks(flat[1], row_chunk), targets)
        per = jax.lax.map(lambda b: _online_compare(model, reference, b[0], b[1], vocab_chunk, targets=b[2]),
                          blocks)
    size = weights.size
    per = {k: v.reshape(-1)[:size].reshape(weights.shape) for k, v in per.items()}
    scored = weights > 0

    def total(x):
        return jnp.sum(jnp.where(scored, x * weights, 0.0), axis=-1)

    return {"nll": total(per["lse"] - per["target"]), "ref_nll": total(per["ref_lse"] - per["ref_target"]),
            "kl": total(per["kl"]), "agree": total(per["agree"]), "tokens": jnp.sum(weights, axis=-1)}


def score_heldout(models: Mapping[str, Any], heldout: HeldoutSet, *, reference: str, batch_size: int = 8,
                  vocab_chunk: int = 16384, row_chunk: int = 256, log: Callable[[str], None] | None = None,
                  reference_cache: dict | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Per model (name -> per-passage arrays `nll`, `ref_nll`, `kl`, `agree`, `tokens`, float64) on `heldout`,
    against `models[reference]`. `log` gets one line per model with its time (default: print on process 0).
    `reference_cache`: a dict the caller keeps across calls with the same unchanged reference model, so its
    hidden states on this set are computed once (a search scores many students against one teacher)."""
    if reference not in models:
        raise ValueError(f"reference {reference!r} is not one of the models {list(models)}; pass reference=.")
    log = log or say
    ref_model = models[reference]
    ref_graph, ref_state = nnx.split(ref_model)
    mesh = model_mesh(ref_model)
    fill = -len(heldout.rows) % batch_size
    rows = np.concatenate([heldout.rows, np.zeros((fill, heldout.rows.shape[1]), np.int32)])
    mask = np.concatenate([heldout.loss_mask, np.zeros((fill, heldout.rows.shape[1]), np.float32)])
    batches = [same_on_every_process({"input_ids": rows[i:i + batch_size], "loss_mask": mask[i:i + batch_size]},
                                     mesh) for i in range(0, len(rows), batch_size)]

    started = time.perf_counter()
    key = (heldout.name, heldout.rows.shape, batch_size)
    if reference_cache is not None and key in reference_cache:
        ref_hidden = reference_cache[key]
    else:
        ref_hidden = [_ref_forward(ref_graph, ref_state, batch) for batch in batches]
        if reference_cache is not None:
            reference_cache[key] = ref_hidden
    jax.block_until_ready(ref_hidden)  # the time below is the forward's, not its dispatch's
    log(f"[eval {heldout.name}] {reference}: hidden states of {heldout.tokens:,} tokens in "
        f"{time.perf_counter() - started:.0f} s")
    results = {}
    others = [name for name in models if name != reference]
    for number, name in enumerate(others, start=1):
        model = models[name]
        started = time.perf_counter()
        graph, state = nnx.split(model)  # models of one shape share a graph, so the scorer compiles once
        results[name] = _model_scores(graph, ref_graph, state, ref_state, batches, ref_hidden,
                                        len(heldout.rows), vocab_chunk, row_chunk)
        ce = results[name]["nll"].sum() / max(results[name]["tokens"].sum(), 1)
        log(f"[eval {heldout.name}] {number}/{len(others)} {name}: CE {ce:.4f} "
            f"({time.perf_counter() - started:.0f} s)")
    if others:  # the reference's own scores came with every pass: no pass of its own
        first = results[others[0]]
        results[reference] = {"nll": first["ref_nll"], "ref_nll": first["ref_nll"], "kl": np.zeros_like(first["kl"]),
                              "agree": first["tokens"].copy(), "tokens": first["tokens"]}
    else:  # the reference alone (every other model has a vocabulary of its own): its CE from its hidden states
        started = time.perf_counter()
        parts = [_self_score(ref_graph, ref_state, batch, h, vocab_chunk, row_chunk)
                 for batch, h in zip(batches, ref_hidden)]
        results[reference] = _gathered(parts, len(heldout.rows))
        ce = results[reference]["nll"].sum() / max(results[reference]["tokens"].sum(), 1)
        log(f"[eval {heldout.name}] {reference}: CE {ce:.4f} ({time.perf_counter() - started:.0f} s)")
    return {name: results[name] for name in models}


def _model_scores(graph, ref_graph, state, ref_state, batches, hidden, n, vocab_chunk, row_chunk):
    """Per-passage scores of one model (graph, state) against the reference, over every batch."""
    return _gathered([_score(graph, ref_graph, state, ref_state, batch, h, vocab_chunk, row_chunk)
                      for batch, h in zip(batches, hidden)], n)


def _gathered(parts: list[dict], n: int) -> dict[str, np.ndarray]:
    """Per-batch scores as per-passage float64 arrays on the host (the padding rows dropped)."""
    return {key: np.concatenate([to_host(p[key]) for p in parts])[:n].astype(np.float64) for key in SCORE_KEYS}


@functools.partial(jax.jit, static_argnums=(0,))
def _ref_forward(ref_graph, ref_state, batch):
    model = nnx.merge(ref_graph, ref_state)
    return model(batch["input_ids"], **forward_inputs(model, batch), return_logits=False).final_hidden


@functools.partial(jax.jit, static_argnums=(0, 1, 6, 7))
def _score(graph, ref_graph, state, ref_state, batch, hidden, vocab_chunk, row_chunk):
    return _row_scores(nnx.merge(graph, state), nnx.merge(ref_graph, ref_state), batch, hidden, vocab_chunk,
                       row_chunk)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _self_score(graph, state, batch, hidden, vocab_chunk, row_chunk):
    model = nnx.merge(graph, state)
    return _row_scores(model, model, batch, hidden, vocab_chunk, row_chunk, hidden=hidden)



# ------------------------------------------------------------------------------------------------ summaries
def summarise(scores: Mapping[str, np.ndarray], heldout: HeldoutSet) -> dict[str, float | int]:
    """Cross-entropy per token and per byte, KL(reference || model) and top-1 agreement per token."""
    tokens = float(scores["tokens"].sum())
    if tokens == 0:
        raise ValueError(f"held-out set {heldout.name!r} has no scored token.")
    nll = float(scores["nll"].sum())
    return {"ce": nll / tokens, "ce_per_byte": nll / heldout.bytes, "kl": float(scores["kl"].sum()) / tokens,
            "top1_agreement": float(scores["agree"].sum()) / tokens, "tokens": int(tokens), "bytes": heldout.bytes,
            "passages": len(heldout.rows), "documents": heldout.num_documents}


def paired_interval(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], heldout: HeldoutSet,
                    metric: str = "ce", *, samples: int = 2000, level: float = 0.95,
                    seed: int = 0) -> tuple[float, float | None, float | None]:
    """(difference a - b, low, high): the difference of `metric` (`ce`, `ce_per_byte`, `kl`,
    `top1_agreement`) between two models scored on the same passages, with a percentile interval from a paired
    bootstrap over documents (each resample draws documents with replacement and recomputes both models' ratio
    metric on the same draw). A set of one document has no interval (None, None)."""
    key, per_byte = {"ce": ("nll", False), "ce_per_byte": ("nll", True), "kl": ("kl", False),
                     "top1_agreement": ("agree", False)}[metric]
    groups = np.unique(heldout.documents, return_inverse=True)[1]
    count = groups.max() + 1
    if count < 2:
        point = (a[key].sum() - b[key].sum()) / (heldout.passage_bytes if per_byte else a["tokens"]).sum()
        return float(point), None, None  # one document: nothing to resample
    denominator = heldout.passage_bytes if per_byte else a["tokens"]
    sums = [np.bincount(groups, weights=x, minlength=count) for x in (a[key], b[key], denominator)]
    draws = np.random.default_rng([seed, 0xB007]).integers(0, count, (samples, count))
    weight = np.stack([np.bincount(row, minlength=count) for row in draws]).astype(np.float64)
    num_a, num_b, den = (weight @ s for s in sums)
    diffs = (num_a - num_b) / den
    point = (sums[0].sum() - sums[1].sum()) / sums[2].sum()
    tail = (1 - level) / 2
    return float(point), float(np.quantile(diffs, tail)), float(np.quantile(diffs, 1 - tail))


def heldout_report(models: Mapping[str, Any], heldout: HeldoutSet, *, reference: str,
                   pairs: Sequence[tuple[str, str]] = (), batch_size: int = 8, vocab_chunk: int = 16384,
                   seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Everything a report needs about one set: per-model summaries and, for each pair (a, b) (default: every
    model against the reference), the differences a - b of CE, CE per byte and KL with 95% intervals."""
    scores = score_heldout(models, heldout, reference=reference, batch_size=batch_size, vocab_chunk=vocab_chunk,
                           log=log)
    pairs = list(pairs) or [(name, reference) for name in models if name != reference]
    comparisons = []
    for a, b in pairs:
        entry: dict[str, Any] = {"a": a, "b": b}
        for metric in ("ce", "ce_per_byte", "kl", "top1_agreement"):
            point, low, high = paired_interval(scores[a], scores[b], heldout, metric, seed=seed)
            entry[metric] = {"difference": point, "low": low, "high": high}
        comparisons.append(entry)
    return {"name": heldout.name, "description": heldout.description, "tokens": heldout.tokens,
            "bytes": heldout.bytes, "passages": len(heldout.rows), "documents": heldout.num_documents,
            "models": {name: summarise(s, heldout) for name, s in scores.items()}, "comparisons": comparisons}


def report_markdown(report: dict, reference: str) -> str:
    """One held-out set's report as Markdown: a table per model, then the paired differences."""
    lines = [f"### {report['name']}: {report['description'] or 'held-out text'}", "",
             f"{report['tokens']:,} scored tokens, {report['bytes']:,} bytes, {report['passages']} passages from "
             f"{report['documents']} documents.", "",
             "| model | CE (nats/token) | CE (nats/byte) | KL(ref \\|\\| model) | top-1 agreement |", "|---|---:|---:|---:|---:|"]
    for name, row in report["models"].items():
        ref = name == reference
        lines.append(f"| {name} | {row['ce']:.4f} | {row['ce_per_byte']:.4f} | "
                     f"{'(reference)' if ref else format(row['kl'], '.4f')} | "
                     f"{'(reference)' if ref else format(row['top1_agreement'], '.2%')} |")
    trimmed = [t for t in report.get("tokenizations", []) if t["vocab_size"] is not None]
    for group in trimmed:  # heldout_vocab: students with a trimmed vocabulary, in their own tokens
        floor = group.get("reference_ce_per_byte")  # absent from reports written before it was recorded
        lines += ["", f"{', '.join(group['models'])}: a trimmed vocabulary of {group['vocab_size']:,} pieces, scored "
                  f"in its own tokens ({group['tokens']:,} on the same passages); KL and top-1 agreement against the "
                  f"{group['reference']} (renormalised). CE per token does not compare across tokenizers; CE per "
                  "byte does." + ("" if floor is None else
                                  f" The {group['reference']}, reading these tokens, scores {floor:.4f} nats/byte: "
                                  "what a student that matched it exactly would score, the floor of its distillation.")]
    if report["comparisons"]:
        lines += ["", "Paired differences (a - b) with 95% intervals (bootstrap over documents):", "",
                  "| a | b | CE | CE per byte | KL |", "|---|---|---:|---:|---:|"]
        for c in report["comparisons"]:
            cells = ["n/a (tokenizers differ)" if c[m] is None else interval_text(c[m])
                     for m in ("ce", "ce_per_byte", "kl")]
            lines.append(f"| {c['a']} | {c['b']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_text(difference: dict) -> str:
    """A comparison's metric (`difference`, `low`, `high`) as "+0.0123 [-0.0010, +0.0250]"; a set of one document
    has no interval: "+0.0123 (one document)"."""
    if difference["low"] is None:
        return f"{difference['difference']:+.4f} (one document)"
    return f"{difference['difference']:+.4f} [{difference['low']:+.4f}, {difference['high']:+.4f}]"


__all__ = ["HeldoutSet", "score_heldout", "summarise", "paired_interval", "heldout_report", "report_markdown"]
