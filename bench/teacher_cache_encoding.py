"""How big and how wrong is each teacher-cache encoding (distill.inputs.cache_format)? Measured on a real teacher's
top k over packed rows of text (default: the real Gemma 3 270M folder that tests/real_gemma.py makes, and
standard library source).

    python bench/teacher_cache_encoding.py --out bench/results/teacher-cache-encoding.jsonl

For k = 16, 64, 128 (the top 128 computed once, exactly, by distill.inputs.topk_cache.topk_logprobs in vocabulary
chunks; smaller k are its prefixes, with the residual of that k) and each encoding, one record:
bytes per token (the top k and residual, plus the row's own id and flags that every encoding stores), the max
absolute error of the decoded log-probabilities (all k, and those within 12 nats of the top 1), the max error of
the residual, and the KL between the exact top-k-renormalised distribution and the decoded one (mean and max
over tokens). `--selection sampled`: the same for caches of k stratified draws (their own k each; the KL of the
decoded shares against the exact ones), and how far a token's shares are from the teacher's distribution (squared
error summed over the vocabulary, mean over tokens); `--selection mixed`: the same for the top k/2 and k/2 draws of
the rest. DistillKit's published sizes to compare: about 300 bytes/token at k=128, 114 at k=50.
"""
from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

REFERENCE = os.path.expanduser("~/.cache/nnx-surgery/reference/gemma3-270m-transformers-f32")
FILES = ("textwrap.py", "string.py", "bisect.py", "heapq.py")


def exact_topk(folder: str, rows: int, seq_len: int, k: int):
    import jax.numpy as jnp

    from nnx_surgery import distill, surgery
    from nnx_surgery.distill.inputs.topk_cache import topk_function

    files = [os.path.join(sysconfig.get_paths()["stdlib"], name) for name in FILES]
    data = distill.TokenBatches.from_files(files, folder, seq_len=seq_len, batch_size=rows, seed=0)
    batch = {key: jnp.asarray(value) for key, value in data.next_batch().items() if key != "loss_mask"}
    teacher = surgery.load_pretrained(folder, dtype="float32")
    start = time.perf_counter()
    ids, logprobs, _ = topk_function(teacher, k, vocab_chunk=16384, block_rows=256)(batch)
    seconds = time.perf_counter() - start
    return ids, logprobs, int(teacher.head_matrix().shape[0]), seconds  # (rows, seq_len, k)


def drawn(folder: str, rows: int, seq_len: int, k: int, mixed: bool = False):
    """As `exact_topk`, with the k slots holding k stratified draws of the teacher's distribution
    (`CacheSettings(selection="sampled")`, seed 0; `mixed`: its top k/2 and draws of the rest), and each token's
    squared error to the teacher's distribution."""
    import jax.numpy as jnp

    from nnx_surgery import distill, surgery
    from nnx_surgery.distill.inputs.teacher_samples import sampled_function

    files = [os.path.join(sysconfig.get_paths()["stdlib"], name) for name in FILES]
    data = distill.TokenBatches.from_files(files, folder, seq_len=seq_len, batch_size=rows, seed=0)
    batch = {key: jnp.asarray(value) for key, value in data.next_batch().items() if key != "loss_mask"}
    teacher = surgery.load_pretrained(folder, dtype="float32")
    start = time.perf_counter()
    ids, logprobs, _ = sampled_function(teacher, k, 0, mixed=mixed, vocab_chunk=16384, block_rows=256)(
        batch, np.arange(rows))
    seconds = time.perf_counter() - start
    return ids, logprobs, int(teacher.head_matrix().shape[0]), seconds, target_error(teacher, batch, ids, logprobs)


def target_error(teacher, batch, ids, logprobs) -> float:
    """Mean over tokens of sum_v (share_v - p_v)^2, the slots' shares against the teacher's distribution p, one row
    of full logits at a time: sum p^2 - 2 sum share p + sum share^2 (a token's slots hold distinct ids)."""
    import jax
    import jax.numpy as jnp

    total, count = 0.0, 0
    for row in range(ids.shape[0]):
        one = {key: value[row:row + 1] for key, value in batch.items()}
        logits = teacher(one["input_ids"], positions=one.get("positions"), segment_ids=one.get("segment_ids")).logits
        p = np.asarray(jax.nn.softmax(logits[0].astype(jnp.float32), -1), np.float64)
        shares = np.exp(logprobs[row].astype(np.float64))
        at = np.take_along_axis(p, ids[row].astype(np.int64), -1)
        total += float(np.sum((p * p).sum(-1) - 2 * (shares * at).sum(-1) + (shares * shares).sum(-1)))
        count += p.shape[0]
    return total / count


def measure_draws(ids, logprobs, vocab: int, k: int, encoding: str, selection: str = "sampled") -> dict:
    """Bytes per token of a cache of k draws in `encoding`, the distinct pieces per token, and the KL between the
    exact shares and the decoded ones (a token's unused slots repeat its first id with share 0)."""
    from nnx_surgery.distill.inputs import cache_format as fmt

    residual = np.full(ids.shape[:-1], -np.inf, np.float32)
    stored = fmt.encode(ids, logprobs, residual, encoding, vocab)
    decoded = fmt.decode(stored, encoding, vocab, k)
    flat_ids, want = ids.reshape(-1, k), np.exp(logprobs.reshape(-1, k).astype(np.float64))
    got_ids = decoded["topk_ids"].reshape(-1, k)
    got = np.exp(decoded["topk_logprobs"].reshape(-1, k).astype(np.float64))
    kls = []
    for token in range(len(flat_ids)):
        p, q = {}, {}
        for piece, share in zip(flat_ids[token], want[token]):
            p[piece] = p.get(piece, 0.0) + share
        for piece, share in zip(got_ids[token], got[token]):
            q[piece] = q.get(piece, 0.0) + share
        total = sum(q.values())
        kls.append(sum(v * np.log(v / (q[piece] / total)) for piece, v in p.items() if v > 0))
    own = fmt.token_dtype(vocab).itemsize + 1
    return {"k": k, "encoding": encoding, "vocab": vocab, "selection": selection,
            "bytes_per_token": sum(a.nbytes for a in stored.values()) / len(flat_ids) + own,
            "distinct_per_token": float(np.mean(np.isfinite(logprobs.reshape(-1, k)).sum(-1))),
            "kl_mean": float(f"{np.mean(kls):.3g}"), "kl_max": float(f"{np.max(kls):.3g}")}


def _renormalised(logprobs: np.ndarray) -> np.ndarray:
    shifted = logprobs.astype(np.float64)
    return shifted - np.logaddexp.reduce(shifted, axis=-1, keepdims=True)


def _by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(values, order, -1)


def measure(ids, logprobs, vocab: int, k: int, encoding: str) -> dict:
    """One encoding at one k of (rows, seq_len, k) top-k arrays (q8z compresses row by row, as in a shard)."""
    from nnx_surgery.distill.inputs import cache_format as fmt

    ids, logprobs = ids[..., :k], logprobs[..., :k]
    with np.errstate(divide="ignore"):  # -inf where the top k hold all the mass
        residual = np.log1p(-np.clip(np.exp(logprobs.astype(np.float64)).sum(-1), 0, 1)).astype(np.float32)
    started = time.perf_counter()
    stored = fmt.encode(ids, logprobs, residual, encoding, vocab)
    encode_s, started = time.perf_counter() - started, time.perf_counter()
    decoded = fmt.decode(stored, encoding, vocab, k)
    decode_s = time.perf_counter() - started
    ids, logprobs, residual = ids.reshape(-1, k), logprobs.reshape(-1, k), residual.reshape(-1)
    decoded = {key: value.reshape(len(ids), -1) if key != "residual" else value.reshape(-1)
               for key, value in decoded.items()}
    got_ids, got_values = _by_id(decoded["topk_ids"], decoded["topk_logprobs"])  # q8z: ties in either order
    want_ids, want_values = _by_id(ids, logprobs)
    assert np.array_equal(got_ids, want_ids)
    error = np.abs(got_values.astype(np.float64) - want_values)
    near = want_values > logprobs[:, :1] - 12
    p = _renormalised(want_values)
    kl = (np.exp(p) * (p - _renormalised(got_values))).sum(-1)
    finite = np.isfinite(residual)
    own = fmt.token_dtype(vocab).itemsize + 1  # the row's token id and its flags byte
    return {"k": k, "encoding": encoding, "vocab": vocab, "id_bits": fmt.id_bits(vocab),
            "bytes_per_token": sum(a.nbytes for a in stored.values()) / len(ids) + own,
            "encode_ms_per_1k_tokens": round(1e6 * encode_s / len(ids), 2),
            "decode_ms_per_1k_tokens": round(1e6 * decode_s / len(ids), 2),
            "max_abs_logprob_error": float(error.max()), "max_abs_error_within_12_nats": float(error[near].max()),
            "residual_max_abs_error": float(np.abs(decoded["residual"][finite] - residual[finite]).max()),
            "kl_mean": float(f"{kl.mean():.3g}"), "kl_max": float(f"{kl.max():.3g}")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default=REFERENCE, help="a model folder (default: the real Gemma 3 270M)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", help="append the records to this JSONL file")
    parser.add_argument("--selection", choices=("top", "sampled", "mixed"), default="top",
                        help="sampled: caches of k stratified draws instead of the top k; mixed: the top k/2 and "
                        "k/2 draws of the rest (bytes, distinct pieces per token, KL of the decoded shares, squared "
                        "error to the teacher's distribution)")
    args = parser.parse_args(argv)
    if args.selection != "top":
        for k in (16, 64, 128):
            ids, logprobs, vocab, seconds, error = drawn(args.teacher, args.rows, args.seq_len, k,
                                                         mixed=args.selection == "mixed")
            for encoding in ("exact", "q8", "q8z"):
                record = measure_draws(ids, logprobs, vocab, k, encoding, args.selection)
                record.update(tokens=ids.shape[0] * ids.shape[1], rows=ids.shape[0], draw_s=round(seconds, 1),
                              target_sq_error=float(f"{error:.4g}"),
                              teacher=os.path.basename(os.path.normpath(args.teacher)))
                common.emit(record, args.out)
        return
    ids, logprobs, vocab, seconds = exact_topk(args.teacher, args.rows, args.seq_len, 128)
    print(f"[bench] top 128 of {vocab:,} over {ids.shape[0] * ids.shape[1]} tokens in {seconds:.1f} s (with "
          "compilation)", flush=True)
    for k in (16, 64, 128):
        for encoding in ("exact", "float16", "q16", "q8", "q8z"):
            record = measure(ids, logprobs, vocab, k, encoding)
            record.update(tokens=ids.shape[0] * ids.shape[1], rows=ids.shape[0],
                          teacher=os.path.basename(os.path.normpath(args.teacher)))
            common.emit(record, args.out)


if __name__ == "__main__":
    main()
