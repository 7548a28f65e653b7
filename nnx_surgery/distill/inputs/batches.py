"""Token batches for distillation: tokenise documents, pack them into rows, shuffle rows per epoch, resume.

Documents come from text files (a file, a folder, a glob; `.jsonl` lines are records), HF `datasets` (when the
package is installed), plain Python strings, or pre-tokenised numpy arrays. Each document becomes
`[BOS] tokens [EOS]` (BOS only when the tokenizer adds one, as Gemma's does). A held-out set of whole documents
is split off first (deterministic for the seed; the last `train_only` documents are never held out, e.g. general
text mixed into a domain corpus, so the held-out split is the one the corpus alone gives). The training documents are concatenated and cut into rows of
`seq_len` tokens without padding; the incomplete tail is dropped unless `drop_remainder=False`, which pads it.

A batch is `{"input_ids": int32 (B, T), "loss_mask": float32 (B, T), "positions": int32 (B, T), "segment_ids":
int32 (B, T)}`: `loss_mask[b, t]` weights the prediction made at position t of token t+1. It is 0 in the last
column, where that target is padding, a BOS, or a prompt token (records with a prompt and a completion train only
on the completion). `segment_ids` numbers the documents of a row from 1 (0: padding) and `positions` count from 0
in each document, so the model attends inside each document only and the step scores no target across a boundary:
a packed document trains as it would alone (the part of a document cut by a row end starts the next row at
position 0). With `restart_id` (e.g. the BOS id), that part starts with this token, as a document does: a model
that needs BOS at position 0 (Gemma) is otherwise far worse on such rows, teacher included, and would teach
from its worst predictions; rows then hold seq_len - 1 corpus tokens. `return_segments=False` leaves both out (documents then see each other, as plain packing does).

Each epoch visits every row once in an order drawn from (seed, epoch); a batch that crosses the end of an epoch
takes its remaining rows from the next one, so no row is dropped. `state()` / `restore()` resume exactly. With
`process_count > 1`, each process tokenises its share of the documents (host_shards.py), and all walk one global
order, each keeping its `batch_size / process_count` rows of each batch. `max_positions` (the teacher's
`max_position_embeddings`) refuses longer rows; `check_vocabulary` refuses a tokenizer that is not the teacher's.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .host_shards import tokenize_shared
from .source_reads import reads, source_table, tokens_read
from .sources import DataError, Record, expand_paths, hf_dataset_records, read_records, stdlib_corpus  # noqa: F401


# ------------------------------------------------------------------------------------------------ tokenizers
@dataclass(frozen=True)
class TextTokenizer:
    """What packing needs from a tokenizer: text -> ids without special tokens, and the special ids; `decode`
    (ids -> text, special tokens skipped) is what evaluation needs to score generated text (None: unknown)."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    eos_id: int
    bos_id: int | None = None
    add_bos: bool = False
    pad_id: int = 0
    decode: Callable[[list[int]], str] | None = None


def load_tokenizer(tokenizer: Any, *, eos_id: int | None = None, bos_id: int | None = None,
                   add_bos: bool | None = None, pad_id: int | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> TextTokenizer:
    """Accept a folder (or tokenizer.json), a `tokenizers.Tokenizer`, a transformers tokenizer, or a callable.

    A folder's tokenizer_config.json / special_tokens_map.json supply bos/eos/pad and `add_bos_token`; keyword
    arguments override. A plain callable `text -> ids` needs `eos_id` (and `decode` for generation metrics)."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer
    config: dict = {}
    if isinstance(tokenizer, (str, os.PathLike)):
        folder, file = _tokenizer_file(tokenizer)
        from tokenizers import Tokenizer

        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            if os.path.isfile(os.path.join(folder, name)):
                with open(os.path.join(folder, name)) as f:
                    config.update(json.load(f))
        tokenizer = Tokenizer.from_file(file)
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer
        return _from_tokenizers(tokenizer, config, eos_id, bos_id, add_bos, pad_id, decode)
    if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers tokenizer
        eos = tokenizer.eos_token_id if eos_id is None else eos_id
        bos = tokenizer.bos_token_id if bos_id is None else bos_id
        pad = tokenizer.pad_token_id if pad_id is None else pad_id
        if add_bos is None:  # what transformers itself does when asked for special tokens
            probe = tokenizer("a", add_special_tokens=True)["input_ids"]
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        decode = decode or (lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
        if getattr(tokenizer, "backend_tokenizer", None) is not None:  # fast: use its `tokenizers` object
            return _from_tokenizers(tokenizer.backend_tokenizer, {}, eos, bos, add_bos, pad, decode)
        return _checked(lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"], eos, bos, add_bos,
                        pad, decode)
    if callable(tokenizer):
        return _checked(lambda texts: [list(tokenizer(text)) for text in texts], eos_id, bos_id, bool(add_bos),
                        pad_id, decode)
    raise DataError(f"cannot use {type(tokenizer).__name__} as a tokenizer; pass a folder with tokenizer.json, "
                    "a tokenizers.Tokenizer, a transformers tokenizer or a callable text -> ids.")


def _tokenizer_file(path: str | os.PathLike) -> tuple[str, str]:
    """(folder, tokenizer.json) for a folder or a tokenizer.json path."""
    path = os.fspath(path)
    folder, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (os.path.dirname(path),
                                                                                                 path)
    if not os.path.isfile(file):
        raise DataError(f"no tokenizer.json at {path}; pass the teacher's folder, a tokenizer object or a callable "
                        "text -> ids.")
    return folder, file


def _from_tokenizers(tok, config, eos_id, bos_id, add_bos, pad_id, decode=None) -> TextTokenizer:
    def token_id(key: str, fallbacks: tuple[str, ...]) -> int | None:
        value = config.get(key)
        names = [value.get("content") if isinstance(value, dict) else value] if value else list(fallbacks)
        ids = [tok.token_to_id(name) for name in names if name]
        return next((i for i in ids if i is not None), None)

    eos = eos_id if eos_id is not None else token_id("eos_token", ("<eos>", "</s>", "<|endoftext|>"))
    bos = bos_id if bos_id is not None else token_id("bos_token", ("<bos>", "<s>"))
    pad = pad_id if pad_id is not None else token_id("pad_token", ("<pad>",))
    if add_bos is None:
        add_bos = config.get("add_bos_token")
    if add_bos is None:  # ask the post-processor whether it prepends BOS
        add_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
    decode = decode or (lambda ids, original=tok: original.decode(list(ids), skip_special_tokens=True))
    tok = _plain_text_copy(tok)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return _checked(encode_batch, eos, bos, add_bos, pad, decode)


def _plain_text_copy(tok):
    """A copy that tokenises special-token strings inside documents as plain text (no `<eos>` injection)."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tok.to_str())
    if hasattr(copy, "encode_special_tokens"):
        copy.encode_special_tokens = True
    return copy


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids `tokenizer` can produce (added tokens included): for a folder or tokenizer.json, a
    `tokenizers.Tokenizer` or a transformers tokenizer; None when it cannot tell (a callable, a TextTokenizer)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(_tokenizer_file(tokenizer)[1])
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers tokenizer
        return len(tokenizer)
    return None


def check_vocabulary(tokenizer: Any, vocab_size: int, where: str | None = None) -> int | None:
    """Refuse a tokenizer that is not that of a model whose embedding has `vocab_size` rows: more tokens (ids past
    the table), or so many fewer that the table is not just padded (Gemma 3 4B: 262,145 tokens, 262,208 rows;
    more than max(256, 1 %) spare rows means another model's tokenizer). Of a TextTokenizer or callable (size
    unknown) only the special ids are checked. `where` names it in the message (default: its path). Returns the
    token count, or None when unknown."""
    where = where or (os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else type(tokenizer).__name__)
    count = tokenizer_size(tokenizer)
    if count is None:
        special = {name: getattr(tokenizer, name, None) for name in ("eos_id", "bos_id", "pad_id")}
        beyond = {name: value for name, value in special.items() if value is not None and value >= vocab_size}
        if beyond:
            raise DataError(f"tokenizer {where} has special ids {beyond} beyond the teacher's embedding of "
                            f"{vocab_size:,} rows; use the teacher's own tokenizer.")
        return None
    if count > vocab_size or vocab_size - count > max(256, vocab_size // 100):
        raise DataError(f"tokenizer at {where} has {count:,} tokens but the teacher's embedding has {vocab_size:,} "
                        "rows; use the teacher's own tokenizer (the teacher's folder holds it).")
    return count


def check_positions(seq_len: int, max_positions: int | None, source: str | None = None) -> None:
    """Refuse rows longer than the model supports. `source` says where the limit comes from."""
    if max_positions is not None and seq_len > max_positions:
        raise DataError(f"seq_len {seq_len} is longer than the {max_positions} positions the model supports "
                        f"({source or 'max_positions'}); lower seq_len to at most {max_positions}.")


def _checked(encode_batch, eos, bos, add_bos, pad, decode=None) -> TextTokenizer:
    if eos is None:
        raise DataError("the tokenizer has no EOS token; pass eos_id= (documents are joined with EOS).")
    if add_bos and bos is None:
        raise DataError("add_bos is set but the tokenizer has no BOS token; pass bos_id=.")
    return TextTokenizer(encode_batch, int(eos), None if bos is None else int(bos), bool(add_bos),
                         int(pad) if pad is not None else 0, decode)


# ------------------------------------------------------------------------------------------------ batches
def tokenize_records(records: Sequence[Record], tokenizer: TextTokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each record -> (ids with BOS/EOS, trainable-target flags): BOS and prompt tokens are not targets."""
    texts = [part for r in records for part in ((r,) if isinstance(r, str) else r)]
    encoded = iter(tokenizer.encode_batch(list(texts)) if texts else [])
    documents = []
    for record in records:
        prompt = [] if isinstance(record, str) else list(next(encoded))
        body = list(next(encoded))
        head = [tokenizer.bos_id] if tokenizer.add_bos else []
        ids = np.asarray(head + prompt + body + [tokenizer.eos_id], dtype=np.int32)
        trainable = np.ones(len(ids), dtype=bool)
        trainable[:len(head) + len(prompt)] = False
        documents.append((ids, trainable))
    return documents


def packed_batch(rows: np.ndarray, weights: np.ndarray, kinds: np.ndarray,
                 return_segments: bool = True) -> dict[str, np.ndarray]:
    """A batch of packed rows (ids, trainable-target flags, kinds as `TokenBatches._pack` makes them): input_ids,
    loss_mask and, with `return_segments`, positions and segment_ids (also what a teacher cache's rows become)."""
    mask = np.zeros(rows.shape, np.float32)
    mask[:, :-1] = weights[:, 1:]
    batch = {"input_ids": rows.astype(np.int32), "loss_mask": mask}
    if return_segments:  # for document-aware attention: which document, and the position inside it
        starts, index = kinds == 2, np.arange(rows.shape[1])
        first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        batch["positions"] = np.where(kinds > 0, index - first, 0).astype(np.int32)
        segments = np.cumsum(starts, axis=1) + (~starts[:, :1])
        batch["segment_ids"] = np.where(kinds > 0, segments, 0).astype(np.int32)
    return batch


def stream_state(stream: Any) -> dict[str, Any]:
    """Where a row stream (TokenBatches, a teacher cache's rows) is, and what identifies its rows: a checkpoint's
    data state, in one format for both."""
    return {"epoch": stream.epoch, "position": stream.position, "seed": stream.seed, "num_rows": stream.num_rows,
            "fingerprint": stream.fingerprint}


def changed_identity(stream: Any, state: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved, this stream's) for each identity of `state` that `stream` does not share."""
    return [(key, state[key], getattr(stream, key)) for key in ("seed", "num_rows", "fingerprint")
            if key in state and state[key] != getattr(stream, key)]


class RowStream:
    """What a stream of packed rows saves in a checkpoint (`stream_state`): TokenBatches and a teacher cache's rows."""

    def state(self) -> dict[str, Any]:
        return stream_state(self)


class TokenBatches(RowStream):
    """Packed, shuffled, resumable token batches with a held-out evaluation split (see the module docstring)."""

    def __init__(self, documents: Sequence[tuple[np.ndarray, np.ndarray]], *, seq_len: int, batch_size: int,
                 seed: int = 0, eval_fraction: float = 0.05, eval_documents: int | None = None,
                 eval_batch_size: int | None = None, drop_remainder: bool = True, shuffle: bool = True,
                 pad_id: int = 0, process_index: int = 0, process_count: int = 1, return_segments: bool = True,
                 max_positions: int | None = None, max_positions_source: str | None = None,
                 train_only: int = 0, restart_id: int | None = None, sources: Sequence[str] | None = None):
        if seq_len < 2 or batch_size < 1:
            raise DataError(f"seq_len must be >= 2 and batch_size >= 1 (got {seq_len}, {batch_size}).")
        check_positions(seq_len, max_positions, max_positions_source)
        if not 0 <= process_index < process_count or batch_size % process_count:
            raise DataError(f"batch_size {batch_size} must split evenly over {process_count} processes and "
                            f"process_index {process_index} must be in [0, {process_count}).")
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, int(seed), shuffle
        self.pad_id, self.return_segments = pad_id, return_segments
        self.restart_id = restart_id
        if restart_id is not None and (not return_segments or seq_len < 3):
            raise DataError("restart_id needs return_segments=True (the restart token begins a segment) and "
                            "seq_len >= 3.")
        self.process_index, self.process_count = process_index, process_count
        self.eval_batch_size = eval_batch_size or batch_size
        n = len(documents) - train_only  # the last `train_only` documents are never held out (e.g. a prose mix)
        if not 0 <= train_only <= len(documents):
            raise DataError(f"train_only={train_only} must lie in [0, {len(documents)}] (the number of documents).")
        n_eval = eval_documents if eval_documents is not None else (
            max(1, round(eval_fraction * n)) if eval_fraction > 0 and n >= 2 else 0)
        if n_eval >= n:
            raise DataError(f"{n} document(s) cannot give {n_eval} held-out ones and still leave training data; "
                            "lower eval_fraction/eval_documents or add documents.")
        held_out = set(np.random.default_rng([self.seed, 0xE7A1]).permutation(n)[:n_eval].tolist())
        n = len(documents)
        self.eval_indices = sorted(held_out)
        self.train_indices = [i for i in range(n) if i not in held_out]
        self._rows, self._weights, self._kinds = self._pack([documents[i] for i in self.train_indices],
                                                             pad_last=not drop_remainder)
        self.num_rows = len(self._rows)
        if self.num_rows < batch_size:
            raise DataError(f"the training documents give {self.num_rows} row(s) of {seq_len} tokens, fewer than "
                            f"batch_size {batch_size}; add data or lower seq_len/batch_size.")
        self.sources = source_table(documents, list(sources) if sources is not None else ["text"] * len(documents),
                                    self.train_indices, self._rows.shape[1] - (restart_id is not None),
                                    self.num_rows)  # each source's tokens per row: `source_reads`
        self._eval_docs = [documents[i] for i in self.eval_indices]
        self.eval_records: list[Record] | None = None  # the held-out texts, when built from text (from_records)
        self._eval_cache: list[dict[str, np.ndarray]] | None = None
        self.fingerprint = f"{zlib.crc32(self._rows.tobytes()) ^ zlib.crc32(self._weights.tobytes()):08x}"
        self.epoch, self.position = 0, 0
        self._orders: dict[int, np.ndarray] = {}

    # ---------------------------------------------------------------------------- constructors
    @classmethod
    def from_records(cls, records: Sequence[Record], tokenizer: Any, *, extra_train: Sequence[Record] = (),
                     corpus_name: str = "corpus", extra_sources: Sequence[str] | None = None,
                     **kwargs) -> "TokenBatches":
        """`records`, plus `extra_train` records that only ever train (never held out: e.g. general text mixed
        into a domain corpus, `distill.general_mix`); the held-out split is the one `records` alone gives.
        `corpus_name` names the source of `records`, `extra_sources` that of each extra record (default "general
        mix"), for `source_reads`."""
        check_positions(kwargs.get("seq_len", 2), kwargs.get("max_positions"), kwargs.get("max_positions_source"))
        tok = load_tokenizer(tokenizer)
        kwargs.setdefault("pad_id", tok.pad_id)
        records = list(records) + list(extra_train)
        documents = tokenize_shared(records, tok, tokenize_records, kwargs.get("process_count", 1))  # multi-host
        if extra_sources is not None and len(extra_sources) != len(extra_train):
            raise DataError(f"{len(extra_sources)} extra_sources for {len(extra_train)} extra_train records; name "
                            "the source of each.")
        labels = [corpus_name] * (len(records) - len(extra_train)) + list(
            extra_sources if extra_sources is not None else ["general mix"] * len(extra_train))
        batches = cls(documents, train_only=len(extra_train), sources=labels, **kwargs)
        batches.eval_records = [records[i] for i in batches.eval_indices]
        return batches

    @classmethod
    def from_files(cls, paths, tokenizer: Any, *, separator: str | None = None, text_field: str = "text",
                   prompt_field: str | None = None, completion_field: str | None = None, **kwargs) -> "TokenBatches":
        check_positions(kwargs.get("seq_len", 2), kwargs.get("max_positions"), kwargs.get("max_positions_source"))
        records = read_records(paths, separator=separator, text_field=text_field, prompt_field=prompt_field,
                               completion_field=completion_field)
        return cls.from_records(records, tokenizer, **kwargs)

    @classmethod
    def from_hf_dataset(cls, name_or_path: str, tokenizer: Any, *, split: str | None = None,
                        text_field: str | None = None, prompt_field: str | None = None,
                        completion_field: str | None = None, config_name: str | None = None,
                        max_records: int | None = None, streaming: bool | None = None,
                        **kwargs) -> "TokenBatches":
        """A dataset through HF `datasets`: a Hub name, a `save_to_disk` folder, local data files (.jsonl, .parquet,
        .csv, ...), optionally with options in query form (`data/qa.jsonl?prompt=question&completion=answer`; see
        `sources.parse_hf_spec`). Keyword arguments override those options (defaults: split "train", the "text"
        column, or the prompt/completion columns when there is no text column; a prompt is never trained on)."""
        check_positions(kwargs.get("seq_len", 2), kwargs.get("max_positions"), kwargs.get("max_positions_source"))
        records = hf_dataset_records(name_or_path, split=split, text_field=text_field, prompt_field=prompt_field,
                                     completion_field=completion_field, config_name=config_name,
                                     max_records=max_records, streaming=streaming)
        return cls.from_records(records, tokenizer, **kwargs)

    @classmethod
    def from_arrays(cls, arrays: Iterable[np.ndarray] | np.ndarray, *, eos_id: int, bos_id: int | None = None,
                    **kwargs) -> "TokenBatches":
        """Pre-tokenised documents (1-D int arrays, or the rows of a 2-D array), without BOS/EOS."""
        documents = []
        for array in arrays:
            ids = np.asarray(array)
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise DataError(f"each document must be a 1-D integer array, got {ids.dtype} {ids.shape}.")
            head = [] if bos_id is None else [bos_id]
            full = np.concatenate([np.asarray(head, np.int32), ids.astype(np.int32), np.asarray([eos_id], np.int32)])
            trainable = np.ones(len(full), dtype=bool)
            trainable[:len(head)] = False
            documents.append((full, trainable))
        return cls(documents, **kwargs)

    # ---------------------------------------------------------------------------- packing
    def _pack(self, documents, pad_last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Concatenate documents and cut rows of seq_len: ids, trainable-target flags, and a kind per token
        (2: first token of a document, 1: other token, 0: padding)."""
        T = self.seq_len - (self.restart_id is not None)  # a column is kept for the restart token
        ids = np.concatenate([d[0] for d in documents] or [np.zeros(0, np.int32)])
        weights = np.concatenate([d[1] for d in documents] or [np.zeros(0, bool)])
        kinds: np.ndarray = np.ones(len(ids), dtype=np.int8)
        kinds[np.cumsum([0] + [len(d[0]) for d in documents[:-1]])[:len(documents)]] = 2
        rows = len(ids) // T + (1 if pad_last and len(ids) % T else 0)
        pad = rows * T - len(ids)
        if pad > 0:
            ids = np.concatenate([ids, np.full(pad, self.pad_id, np.int32)])
            weights = np.concatenate([weights, np.zeros(pad, bool)])
            kinds = np.concatenate([kinds, np.zeros(pad, np.int8)])
        n = rows * T
        ids, weights, kinds = ids[:n].reshape(rows, T), weights[:n].reshape(rows, T), kinds[:n].reshape(rows, T)
        if self.restart_id is None:
            return ids, weights, kinds
        # a row that continues a document starts with the restart token (a document of its own start, never a
        # target); a row that starts a document, or padding, gets a padding column instead
        continues = kinds[:, :1] == 1
        head_ids = np.where(continues, self.restart_id, self.pad_id).astype(np.int32)
        head_kinds = np.where(continues, 2, 0).astype(np.int8)
        return (np.concatenate([head_ids, ids], 1), np.concatenate([np.zeros((rows, 1), bool), weights], 1),
                np.concatenate([head_kinds, kinds], 1))

    def _batch(self, rows: np.ndarray, weights: np.ndarray, kinds: np.ndarray) -> dict[str, np.ndarray]:
        return packed_batch(rows, weights, kinds, self.return_segments)

    def _local(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        per = len(batch["input_ids"]) // self.process_count
        lo = self.process_index * per
        return {k: v[lo:lo + per] for k, v in batch.items()}

    # ---------------------------------------------------------------------------- training stream
    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch` (a permutation drawn from (seed, epoch), or 0..R-1 without shuffle)."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
                                   if self.shuffle else np.arange(self.num_rows))
        return self._orders[epoch]

    def next_batch(self) -> dict[str, np.ndarray]:
        picked: list[np.ndarray] = []
        need = self.batch_size
        while need:
            take = self.order(self.epoch)[self.position:self.position + need]
            picked.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
        index = np.concatenate(picked)
        return self._local(self._batch(self._rows[index], self._weights[index], self._kinds[index]))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield self.next_batch()

    def packed_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, loss weights, row kinds) of every training row, in row order (not the shuffled order)."""
        return self._rows, self._weights, self._kinds

    def restore(self, state: dict[str, Any]) -> None:
        for key, saved, ours in changed_identity(self, state):
            raise DataError(f"cannot resume: the saved data state has {key}={saved!r} but this pipeline "
                            f"has {ours!r}; build it from the same data and settings.")
        if not 0 <= int(state["position"]) < self.num_rows or int(state["epoch"]) < 0:
            raise DataError(f"cannot resume: position {state['position']} / epoch {state['epoch']} out of range.")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def source_reads(self, start: dict[str, Any] | None, rows: int) -> dict[str, dict[str, float | int]]:
        """How many times `rows` training rows read from `start` (a `state()`; None: the stream's start) read each
        source (`source_reads.reads`: distinct tokens, tokens read, reads)."""
        epoch, position = (int(start["epoch"]), int(start["position"])) if start else (0, 0)
        return reads(self.sources, tokens_read(self.sources, self.order, epoch, position, int(rows)))

    def calibration_ids(self, num_samples: int, seed: int | None = None) -> np.ndarray:
        """`num_samples` packed training rows (N, seq_len), drawn without replacement from (seed, "calibration"):
        the calibration set for importance scoring. It does not move the training stream."""
        if num_samples < 1:
            raise DataError(f"num_samples={num_samples} must be at least 1.")
        rng = np.random.default_rng([self.seed if seed is None else int(seed), 0xCA1B])
        index = np.sort(rng.permutation(self.num_rows)[:min(num_samples, self.num_rows)])
        return self._rows[index].astype(np.int32)

    # ---------------------------------------------------------------------------- evaluation
    def eval_texts(self) -> list[str]:
        """The held-out documents as text (a prompt/completion record joined), e.g. for `evaluation.suite_scoring`'s prompts
        and multiple-choice items. Only for pipelines built from text (from_files, from_records, ...)."""
        if self.eval_records is None:
            raise DataError("this TokenBatches was built from token arrays, so it has no held-out text; build it "
                            "with from_files/from_records, or pass the held-out documents yourself.")
        return [r if isinstance(r, str) else r[0] + r[1] for r in self.eval_records]

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        """The held-out documents, packed (tail padded, masked), in batches of `eval_batch_size` rows; the last
        batch is filled with fully masked padding rows so every batch has the same shape."""
        if self._eval_cache is None:
            rows, weights, kinds = self._pack(self._eval_docs, pad_last=True)
            size = self.eval_batch_size
            if size % self.process_count:
                raise DataError(f"eval_batch_size {size} must split evenly over {self.process_count} processes.")
            fill = -len(rows) % size
            rows = np.concatenate([rows, np.full((fill, self.seq_len), self.pad_id, np.int32)])
            weights = np.concatenate([weights, np.zeros((fill, self.seq_len), bool)])
            kinds = np.concatenate([kinds, np.zeros((fill, self.seq_len), np.int8)])
            self._eval_cache = [self._local(self._batch(rows[i:i + size], weights[i:i + size], kinds[i:i + size]))
                                for i in range(0, len(rows), size)]
        return self._eval_cache
