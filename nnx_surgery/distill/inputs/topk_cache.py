"""The teacher once: its top-k distribution over every packed training row, written to a folder that later runs
read instead of running the teacher (issue 42).

    identity = {"teacher": folder_identity(teacher_folder), "tokenizer_sha256": ..., ...}
    write_cache(teacher, batches, "cache/", top_k=64, identity=identity)   # batches: a distill.TokenBatches
    cache = TeacherCache.open("cache/")
    cache.check_matches(teacher_config_hash=..., tokenizer_hash=..., seq_len=256)
    for batch in cache.batches(8): ...   # input_ids, loss_mask, positions, segment_ids, topk_ids,
                                         # topk_logprobs, residual: numpy, fixed shapes, ready for a jitted step

What is cached is a function of the packed rows only (row r of the packing, whatever the batch size), so one cache
serves any batch size, and `batches` replays `TokenBatches`'s order (its seed's permutation per epoch, each
process its rows of each batch): the same rows in the same order as online training.

The top k come from the teacher's final hidden states and its head in vocabulary chunks, a block of positions at
a time (`topk_logprobs`): the running top k of the chunks seen and their running log-sum-exp, so no (B, T, V)
array exists (the peak is one block x one chunk of logits). Storage and its encodings: `distill.inputs.cache_format`.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import cache_format as fmt
from .cache_format import CacheError
from nnx_surgery.distill.inputs.batches import packed_batch
from nnx_surgery.distill.mesh import put_batch, shard_model
from nnx_surgery.distill.inputs.teacher_samples import final_hidden_and_head, sampled_function

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DISTINCT_SLOTS = "distinct"  # a mixed manifest's "slots": written by a version whose draws never repeat an exact id
SELECTIONS = ("top", "sampled", "mixed")  # what a token's k slots hold: the teacher's top k, k draws of it, or
# its top k // 2 and draws of the rest (teacher_samples)


# ------------------------------------------------------------------------------------------------ the top k
def _block_topk(logits_fn: Callable, hidden: jax.Array, head_chunks: jax.Array, vocab_size: int, k: int):
    """(ids, log-probabilities, residual) of hidden (R, D) against a head cut in chunks (n, C, D)."""
    rows, chunk = hidden.shape[0], head_chunks.shape[1]
    kept = min(k, chunk)

    def step(carry, xs):
        best, best_ids, lse = carry
        index, head = xs
        logits = logits_fn(hidden, head)
        ids = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        logits = jnp.where(ids < vocab_size, logits, -jnp.inf)  # the padding of the last chunk
        lse = jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1))
        values, where = jax.lax.top_k(logits, kept)
        merged, order = jax.lax.top_k(jnp.concatenate([best, values], -1), k)  # earlier (lower) ids win ties
        merged_ids = jnp.take_along_axis(jnp.concatenate([best_ids, ids[where]], -1), order, -1)
        return (merged, merged_ids, lse), None

    start = (jnp.full((rows, k), -jnp.inf, jnp.float32), jnp.zeros((rows, k), jnp.int32),
             jnp.full((rows,), -jnp.inf, jnp.float32))
    xs = (jnp.arange(head_chunks.shape[0], dtype=jnp.int32), head_chunks)
    (values, ids, lse), _ = jax.lax.scan(step, start, xs)
    logprobs = values - lse[:, None]
    mass = jnp.clip(jnp.sum(jnp.exp(logprobs), -1), 0.0, 1.0)
    return ids, logprobs, jnp.log1p(-mass)  # -inf when the top k hold all of it


def topk_logprobs(model: Any, batch: Mapping[str, jax.Array], k: int, *, vocab_chunk: int = 8192,
                  block_rows: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The teacher's top-k ids (B, T, k) int32, their log-probabilities at temperature 1 (B, T, k) float32,
    sorted most likely first, and the log of the mass outside them (B, T), for a batch of rows. Traceable (jit
    it with the model split, as `topk_function` does)."""
    hidden, head, vocab = final_hidden_and_head(model, batch, vocab_chunk)
    b, t, d = hidden.shape
    flat = hidden.reshape(b * t, d)
    rows = min(block_rows, b * t)
    blocks = jnp.pad(flat, [(0, -flat.shape[0] % rows), (0, 0)]).reshape(-1, rows, d)
    top_ids, logprobs, residual = jax.lax.map(
        lambda h: _block_topk(model.logits_from_hidden, h, head, vocab, k), blocks)
    return (top_ids.reshape(-1, k)[:b * t].reshape(b, t, k), logprobs.reshape(-1, k)[:b * t].reshape(b, t, k),
            residual.reshape(-1)[:b * t].reshape(b, t))


def topk_function(model: Any, k: int, **settings) -> Callable[[Mapping[str, Any]], tuple[np.ndarray, ...]]:
    """`topk_logprobs` of `model`, jitted once: batch -> host arrays."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda s, batch: topk_logprobs(nnx.merge(graphdef, s), batch, k, **settings))
    return lambda batch: tuple(np.asarray(x) for x in compiled(state, batch))


# ------------------------------------------------------------------------------------------------ identities
def file_sha256(path: str) -> str:
    return fmt.sha256_file(path)


def vocab_map_sha256(teacher_ids: Sequence[int] | None) -> str | None:
    """The identity of a trimmed student's vocabulary map (the teacher id of each student id); None: none."""
    if teacher_ids is None:
        return None
    return hashlib.sha256(np.asarray(teacher_ids, dtype="<i4").tobytes()).hexdigest()


def folder_identity(folder: str) -> dict[str, str]:
    """A model folder's identity: the sha256 of its config.json and one over its safetensors files' bytes."""
    weights = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise CacheError(f"{folder}: no safetensors files to identify the teacher by; give a model folder.")
    for path in files:
        weights.update(f"{os.path.basename(path)}:{fmt.sha256_file(path)}\n".encode())
    return {"config_sha256": file_sha256(os.path.join(folder, "config.json")), "weights_sha256": weights.hexdigest()}


def check_written_by(cache: str, teacher_folder: str, tokenizer_file: str | None = None) -> None:
    """CacheError (one line) unless the cache in `cache` was written by the teacher in `teacher_folder` (its
    config.json and weights' hashes) and, when given, with `tokenizer_file`."""
    identity = folder_identity(teacher_folder)
    TeacherCache.open(cache, verify=False).check_matches(
        teacher_config_hash=identity["config_sha256"], teacher_weights_hash=identity["weights_sha256"],
        tokenizer_hash=file_sha256(tokenizer_file) if tokenizer_file else None)


def packing_of(batches: Any) -> dict[str, Any]:
    """What fixes the packed rows and their order: a TokenBatches' settings and its rows' fingerprint."""
    return {"seq_len": batches.seq_len, "rows": batches.num_rows, "seed": batches.seed,
            "shuffle": batches.shuffle, "restart_id": batches.restart_id, "fingerprint": batches.fingerprint,
            "return_segments": batches.return_segments}


def first_difference(saved: Mapping, wanted: Mapping, prefix: str = "") -> str | None:
    """The first key (dotted) whose value differs, with both values, or None."""
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key), wanted.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found = first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key} is {a!r} in the cache but {b!r} here"
    return None


DRAWN = ("sampled", "mixed")  # selections whose slots hold draws: read whole and renormalised


def slots_text(selection: str, k: int) -> str:
    """What a token's k slots hold, for progress lines and summaries."""
    if selection == "sampled":
        return f"{k} draws"
    if selection == "mixed":
        return f"top {k // 2} and {k - k // 2} draws of the rest"
    return f"top {k}"


# ------------------------------------------------------------------------------------------------ writing
@dataclasses.dataclass(frozen=True)
class CacheSettings:
    top_k: int
    encoding: str = "q8z"
    rows_per_shard: int = 256
    batch_rows: int = 8  # rows per teacher forward
    vocab_chunk: int = 8192
    block_rows: int = 512
    selection: str = "top"  # or "sampled": k stratified draws of the teacher's distribution (teacher_samples)
    sample_seed: int = 0

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise CacheError(f"selection {self.selection!r}: choose {' or '.join(SELECTIONS)}.")
        if self.encoding not in fmt.ENCODINGS:
            raise CacheError(f"encoding {self.encoding!r}: choose one of {', '.join(fmt.ENCODINGS)}.")
        if self.selection == "mixed" and self.top_k < 2:
            raise CacheError(f"selection 'mixed' with top_k {self.top_k}: it keeps the top k // 2 and draws the "
                             "rest, so give top_k >= 2.")
        if self.top_k < 1 or self.rows_per_shard < 1 or self.batch_rows < 1:
            raise CacheError(f"top_k {self.top_k}, rows_per_shard {self.rows_per_shard} and batch_rows "
                             f"{self.batch_rows} must each be at least 1.")


def shard_name(index: int, process: int) -> str:
    return f"shard-p{process:03d}-{index:06d}.safetensors"


def _progress_path(folder: str, process: int) -> str:
    return os.path.join(folder, f"progress-p{process:03d}.json")


def _settings_record(settings: CacheSettings, identity: Mapping, vocab_size: int, seq_len: int) -> dict:
    record = {"format_version": FORMAT_VERSION, "top_k": settings.top_k, "encoding": settings.encoding,
              "rows_per_shard": settings.rows_per_shard, "vocab_size": vocab_size, "seq_len": seq_len,
              "id_bits": fmt.id_bits(vocab_size), "token_dtype": fmt.token_dtype(vocab_size).name,
              "logprob_temperature": 1.0, "identity": json.loads(json.dumps(identity))}
    if settings.selection != "top":  # a top-k cache's manifest is as it always was
        record.update(selection=settings.selection, sample_seed=settings.sample_seed)
    if settings.selection == "mixed":  # its drawn slots exclude the exact half by id (`repeated_slots`)
        record["slots"] = DISTINCT_SLOTS
    return record


def repeated_slots(ids: np.ndarray, logprobs: np.ndarray) -> int:
    """How many positions of (..., k) slots give some id a share twice (slots of log share -inf hold none)."""
    held = np.where(np.isfinite(logprobs), ids.astype(np.int64), -1 - np.arange(ids.shape[-1]))
    ordered = np.sort(held.reshape(-1, ids.shape[-1]), axis=-1)
    return int(np.sum(np.any(ordered[:, 1:] == ordered[:, :-1], axis=-1)))


def _finished(folder: str, process: int, record: dict, resume: bool) -> dict[int, dict]:
    """Shards of this process already written and intact (checksum), when resuming with the same settings."""
    path = _progress_path(folder, process)
    if not resume or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    difference = first_difference(saved["settings"], record)
    if difference:
        raise CacheError(f"--resume {folder}: the partial cache was made with other settings ({difference}); "
                         "give the same teacher, data and settings, or write a new cache (--overwrite).")
    return {entry["index"]: entry for entry in saved["shards"]
            if os.path.isfile(os.path.join(folder, entry["file"]))
            and fmt.sha256_file(os.path.join(folder, entry["file"])) == entry["sha256"]}


def _shard_bytes(teacher_topk: Callable, rows: np.ndarray, weights: np.ndarray, kinds: np.ndarray,
                 row_index: np.ndarray, settings: CacheSettings, vocab_size: int, put: Callable,
                 return_segments: bool) -> bytes:
    from safetensors.numpy import save


    parts = []
    for lo in range(0, len(rows), settings.batch_rows):
        sl = slice(lo, lo + settings.batch_rows)
        batch = packed_batch(rows[sl], weights[sl], kinds[sl], return_segments)
        batch.pop("loss_mask")
        pad = settings.batch_rows - len(batch["input_ids"])  # one compiled shape: pad the last forward
        batch = {key: np.pad(value, [(0, pad), (0, 0)]) for key, value in batch.items()}
        ids, logprobs, residual = teacher_topk(put(batch), np.pad(row_index[sl], [(0, pad)]))
        parts.append((ids[:len(ids) - pad], logprobs[:len(ids) - pad], residual[:len(ids) - pad]))
    ids, logprobs, residual = (np.concatenate(p) for p in zip(*parts))
    stored = fmt.encode(ids, logprobs, residual, settings.encoding, vocab_size)
    stored["input_ids"] = rows.astype(fmt.token_dtype(vocab_size))
    stored["flags"] = (kinds.astype(np.uint8) | (weights.astype(np.uint8) << 2))
    return save({key: np.ascontiguousarray(value) for key, value in stored.items()})


def write_cache(teacher: Any, batches: Any, folder: str, settings: CacheSettings, *, identity: Mapping,
                mesh: Any = None, resume: bool = False, process_index: int | None = None,
                process_count: int | None = None, after_shard: Callable[[int], None] | None = None,
                row_ids: Sequence[int] | np.ndarray | None = None) -> dict:
    """Run `teacher` over every packed training row of `batches` (a TokenBatches), or only the packed rows
    `row_ids` (e.g. `rows_ahead`: those a run of some steps will read), and write the cache into `folder`; returns
    the manifest. Shard i holds the i-th `rows_per_shard` of those rows and is written by process
    i % process_count, atomically, its checksum then recorded in the process's progress file; `resume` keeps the
    intact shards of a partial cache with the same settings. Process 0 writes manifest.json once every shard is
    listed. `after_shard(i)` is called after each shard (tests interrupt there)."""
    process = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    vocab = int(teacher.head_matrix().shape[0])
    if not 1 <= settings.top_k <= vocab:
        raise CacheError(f"top_k {settings.top_k}: must lie in [1, {vocab:,}], the teacher's vocabulary.")
    record = _settings_record(settings, {**identity, "packing": packing_of(batches)}, vocab, batches.seq_len)
    rows, weights, kinds = batches.packed_rows()
    subset = _row_subset(row_ids, len(rows))
    if subset is not None:  # progress files keep its digest; the manifest, written once, the rows themselves
        record["row_ids_sha256"] = hashlib.sha256(subset.astype("<i8").tobytes()).hexdigest()
        rows, weights, kinds = rows[subset], weights[subset], kinds[subset]
    os.makedirs(folder, exist_ok=True)
    done = _finished(folder, process, record, resume)
    if mesh is not None:
        teacher = shard_model(teacher, mesh)
        put = lambda batch: put_batch(batch, mesh)  # noqa: E731
    else:
        put = lambda batch: {key: jnp.asarray(value) for key, value in batch.items()}  # noqa: E731
    run = _teacher_function(teacher, settings)
    packed_index = np.arange(len(rows)) if subset is None else subset
    per = settings.rows_per_shard
    for index in range(process, -(-len(rows) // per), count):
        if index in done:
            continue
        sl = slice(index * per, (index + 1) * per)
        data = _shard_bytes(run, rows[sl], weights[sl], kinds[sl], packed_index[sl], settings, vocab, put,
                            batches.return_segments)
        name = shard_name(index, process)
        fmt.atomic_bytes(os.path.join(folder, name), data)
        done[index] = {"index": index, "file": name, "rows": len(rows[sl]), "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()}
        fmt.atomic_json(_progress_path(folder, process),
                        {"settings": record, "shards": [done[i] for i in sorted(done)]})
        if after_shard is not None:
            after_shard(index)
    if count > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("teacher cache shards written")
    if process != 0:
        return record
    return _write_manifest(folder, record, batches.num_rows, None if subset is None else subset.tolist())


def _teacher_function(teacher: Any, settings: CacheSettings) -> Callable:
    """(batch, the rows' packed indices) -> the k slots of every token: the top k, or k draws (teacher_samples)."""
    chunks = dict(vocab_chunk=settings.vocab_chunk, block_rows=settings.block_rows)
    if settings.selection in DRAWN:
        return sampled_function(teacher, settings.top_k, settings.sample_seed, mixed=settings.selection == "mixed",
                                **chunks)
    top = topk_function(teacher, settings.top_k, **chunks)
    return lambda batch, row_index: top(batch)


def _row_subset(row_ids: Sequence[int] | np.ndarray | None, num_rows: int) -> np.ndarray | None:
    if row_ids is None:
        return None
    subset = np.unique(np.asarray(row_ids, dtype=np.int64))
    if not len(subset) or subset[0] < 0 or subset[-1] >= num_rows:
        raise CacheError(f"row_ids: give packed rows in [0, {num_rows}) (at least one).")
    return subset


def rows_ahead(batches: Any, count: int) -> np.ndarray:
    """The packed rows (sorted, unique) that `batches` serves in its next `count` rows from where it stands (its
    order, epoch after epoch), without moving it: what a cache for a run of `count` rows must hold."""
    state = batches.state()  # past the rest of this epoch and one whole epoch, every row has been read
    index, _, _ = next_rows(batches.order, batches.num_rows, int(state["epoch"]), int(state["position"]),
                            min(count, 2 * batches.num_rows))
    return np.unique(index)


def next_rows(order: Callable[[int], np.ndarray], num_rows: int, epoch: int, position: int, count: int
              ) -> tuple[np.ndarray, int, int]:
    """The next `count` packed rows of a stream at (`epoch`, `position`) in `order(epoch)`'s permutations (an
    epoch's last rows continue into the next epoch's order), and the (epoch, position) after them."""
    picked = []
    while count > 0:
        take = order(epoch)[position:position + count]
        picked.append(take)
        count, position = count - len(take), position + len(take)
        if position == num_rows:
            epoch, position = epoch + 1, 0
    return (np.concatenate(picked) if picked else np.zeros(0, np.int64)), epoch, position


def _write_manifest(folder: str, record: dict, num_rows: int, row_ids: list[int] | None) -> dict:
    shards = []
    for path in sorted(glob.glob(os.path.join(folder, "progress-p*.json"))):
        with open(path, encoding="utf-8") as handle:
            shards += json.load(handle)["shards"]
    shards.sort(key=lambda entry: entry["index"])
    manifest = {**record, "num_rows": num_rows, "shards": shards}
    if row_ids is not None:  # a cache of these packed rows only
        manifest["row_ids"] = row_ids
    fmt.atomic_json(os.path.join(folder, MANIFEST), manifest)
    return manifest


# ------------------------------------------------------------------------------------------------ reading
class TeacherCache:
    """A written cache: `open` checks the manifest and every shard's checksum, `batches` replays the training
    order with the cached top k beside each row."""

    def __init__(self, folder: str, manifest: dict, shards: list[fmt.ShardReader]):
        self.folder, self.manifest, self._shards = folder, manifest, shards
        self.top_k, self.encoding = manifest["top_k"], manifest["encoding"]
        self.selection = manifest.get("selection", "top")
        self.vocab_size, self.seq_len = manifest["vocab_size"], manifest["seq_len"]
        self.num_rows, self.rows_per_shard = manifest["num_rows"], manifest["rows_per_shard"]
        self.packing = manifest["identity"]["packing"]
        subset = manifest.get("row_ids")  # None: every packed row, in row order
        self.row_ids = None if subset is None else np.asarray(subset, dtype=np.int64)

    @classmethod
    def open(cls, folder: str, *, verify: bool = True) -> "TeacherCache":
        path = os.path.join(folder, MANIFEST)
        try:
            with open(path, encoding="utf-8") as handle:
                manifest = json.load(handle)
        except FileNotFoundError:
            raise CacheError(f"{folder}: no {MANIFEST}, so not a finished teacher cache; write it with "
                             "`nnx-surgery cache-teacher` (add --resume to finish a partial one).") from None
        except ValueError as error:
            raise CacheError(f"{path}: not valid JSON ({error}); write the cache again.") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CacheError(f"{path}: format version {manifest.get('format_version')!r}, this version reads "
                             f"{FORMAT_VERSION}; write the cache again with this version.")
        per, shards = manifest["rows_per_shard"], manifest["shards"]
        expected = -(-len(manifest.get("row_ids") or range(manifest["num_rows"])) // per)
        if [entry["index"] for entry in shards] != list(range(expected)):
            raise CacheError(f"{path}: lists {len(shards)} shard(s) of the {expected} its rows need; finish the "
                             "cache with `nnx-surgery cache-teacher ... --resume`.")
        readers = []
        for entry in shards:
            file = os.path.join(folder, entry["file"])
            if verify and (not os.path.isfile(file) or fmt.sha256_file(file) != entry["sha256"]):
                raise CacheError(f"{file}: missing, truncated or corrupted (its sha256 is not the manifest's); "
                                 "rerun the same cache-teacher command with --resume to write it again.")
            readers.append(fmt.ShardReader(file))
        cache = cls(folder, manifest, readers)
        if verify and cache.selection == "mixed" and manifest.get("slots") != DISTINCT_SLOTS:
            cache._check_slots_distinct()
        return cache

    def _check_slots_distinct(self) -> None:
        """Refuse a `mixed` cache written before its draws excluded the exact half by id, if some position's drawn
        slot repeats an exact slot's id (that id then has two shares: a biased target)."""
        found = 0
        for shard in self._shards:
            rows = len(shard.arrays["input_ids"])
            for start in range(0, rows, 64):
                got = fmt.decode(shard.rows(np.arange(start, min(start + 64, rows))), self.encoding,
                                 self.vocab_size, self.top_k)
                found += repeated_slots(got["topk_ids"], got["topk_logprobs"])
        if found:
            raise CacheError(f"teacher cache {self.folder}: {found:,} position(s) give one id two shares (a 'mixed' "
                             "cache written before its draws excluded the exact half by id, so its targets are "
                             "biased); write it again with this version (`nnx-surgery cache-teacher ... "
                             "--overwrite`).")

    def check_matches(self, **wanted: Any) -> None:
        """Refuse, in one line, a cache made for another teacher, tokenizer or packing. Keys: teacher_config_hash,
        teacher_weights_hash, tokenizer_hash, seq_len, seed, rows, fingerprint, top_k, vocab_map_hash (None: not
        checked)."""
        identity = self.manifest["identity"]
        saved = {"teacher_config_hash": identity.get("teacher", {}).get("config_sha256"),
                 "teacher_weights_hash": identity.get("teacher", {}).get("weights_sha256"),
                 "tokenizer_hash": identity.get("tokenizer_sha256"), "vocab_map_hash": identity.get("vocab_map_sha256"),
                 "top_k": self.top_k, **{key: self.packing.get(key) for key in ("seq_len", "seed", "rows",
                                                                                 "fingerprint")}}
        for key, value in wanted.items():
            if key not in saved:
                raise TypeError(f"check_matches({key}=...): not a cache property; give one of {sorted(saved)}.")
            if value is not None and saved[key] != value:
                raise CacheError(f"teacher cache {self.folder}: made for {key} {saved[key]!r}, not {value!r}; "
                                 "write a cache for this run (`nnx-surgery cache-teacher`).")

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The decoded cache of packed rows `index` (any order): the batch keys of `batches`."""
        index = self._stored_at(np.asarray(index))
        shard, local = index // self.rows_per_shard, index % self.rows_per_shard
        parts: dict[str, np.ndarray] = {}
        for s in np.unique(shard):
            where = np.nonzero(shard == s)[0]
            got = self._shards[s].rows(local[where])
            for key, value in got.items():
                parts.setdefault(key, np.empty((len(index), *value.shape[1:]), value.dtype))[where] = value
        flags = parts.pop("flags")
        batch = packed_batch(parts.pop("input_ids").astype(np.int32), (flags >> 2) & 1, (flags & 3).astype(np.int8),
                             self.packing.get("return_segments", True))
        batch.update(fmt.decode(parts, self.encoding, self.vocab_size, self.top_k))
        return batch

    def _stored_at(self, index: np.ndarray) -> np.ndarray:
        """Where packed rows `index` are stored: the rows themselves, or their places in a subset cache."""
        if self.row_ids is None:
            return index
        where = np.minimum(np.searchsorted(self.row_ids, index), len(self.row_ids) - 1)
        missing = index[self.row_ids[where] != index]
        if len(missing):
            raise CacheError(f"teacher cache {self.folder}: holds {len(self.row_ids):,} of the {self.num_rows:,} "
                             f"packed rows (those its run was to read), not row {int(missing[0])} that this run "
                             "reads; write the cache for this run's steps and batch size.")
        return where

    def order(self, epoch: int) -> np.ndarray:
        """`TokenBatches.order`: the packing's seed's permutation of the rows for `epoch`."""
        if not self.packing.get("shuffle", True):
            return np.arange(self.num_rows)
        return np.random.default_rng([self.packing["seed"], epoch]).permutation(self.num_rows)

    def batches(self, batch_size: int, *, epochs: int | None = None, process_index: int = 0,
                process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
        """Batches of `batch_size` rows in `TokenBatches`'s order (an epoch's last batch continues into the next
        epoch's order, as there); each process gets its `batch_size / process_count` rows of each batch. Stops
        after `epochs` epochs' worth of batches (None: never)."""
        if batch_size % process_count:
            raise CacheError(f"batch_size {batch_size} must split evenly over {process_count} processes.")
        epoch, position, served = 0, 0, 0
        while epochs is None or served + batch_size <= epochs * self.num_rows:
            index, epoch, position = next_rows(self.order, self.num_rows, epoch, position, batch_size)
            per = batch_size // process_count
            served += batch_size
            yield self.rows(index[process_index * per:(process_index + 1) * per])


__all__ = ["FORMAT_VERSION", "DISTINCT_SLOTS", "CacheError", "repeated_slots", "CacheSettings", "TeacherCache", "topk_logprobs", "topk_function",
           "write_cache", "rows_ahead", "next_rows", "folder_identity", "check_written_by", "file_sha256", "vocab_map_sha256", "packing_of", "first_difference", "shard_name"]
