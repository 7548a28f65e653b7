"""Greedy generation on the real Gemma 3 270M (float32, CPU): prefill and decode tokens/s, ours vs transformers.

    python bench/generate.py                          # batch 1 and 8, 128-token prompts, 64 new tokens
    python bench/generate.py --batches 1 --repeats 5

Same model (tests/real_gemma.py's float32 folder, made by transformers from the GGUF), same prompts (rows of
`default_rng(seed).integers(10, V)` after a BOS, `--prompt` tokens in all), same work: greedy, exactly
`--new` tokens per row (no early stop: ours `stop=()`, transformers with its eos unset), no padding. Peers:

* ours          `surgery.modeling.generation.generate`: jitted prefill (logits of the last position only), then a jitted
                `lax.while_loop` of one-token steps over the preallocated KV cache.
* transformers  `model.generate(do_sample=False)` with its default dynamic cache.

Prefill time runs from the call to the first new token (for transformers, its streamer's first `put` of new
tokens); decode time from there to the end, over `new - 1` steps. Each (peer, batch) runs in a fresh process: load,
one warm-up generation (compilation for ours), then `--repeats` timed ones; one JSON line per run with medians,
then a summary with same-run ratios. The peers' tokens are compared (`same_tokens`): the figures are for the same
output.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PEERS = ("ours", "transformers")


def prompts(vocab: int, batch: int, length: int, seed: int, bos: int):
    import numpy as np

    rows = np.random.default_rng(seed).integers(10, vocab, (batch, length - 1))
    return np.concatenate([np.full((batch, 1), bos), rows], axis=1).astype(np.int64)


def digest(tokens) -> str:
    return hashlib.sha256(json.dumps([list(map(int, row)) for row in tokens]).encode()).hexdigest()[:16]


def child_ours(args, folder: str) -> dict:
    import jax

    from nnx_surgery.surgery import load_pretrained
    from nnx_surgery.surgery.modeling.generation import generate

    model = load_pretrained(folder, dtype="float32")
    ids = prompts(model.config.vocab_size, args.batch, args.prompt, args.seed, bos=2)
    jax.block_until_ready(model)
    runs = []
    for _ in range(1 + args.repeats):
        out = generate(model, ids, max_new_tokens=args.new, stop=())
        runs.append((out.prefill_s, out.decode_s, out.tokens))
    return measured(runs[1:], args, runs[0][0] + runs[0][1])


def child_transformers(args, folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Time of each `put`: the prompt first, then each step's new tokens."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly --new tokens, as ours with stop=()
    ids = torch.tensor(prompts(model.config.vocab_size, args.batch, args.prompt, args.seed, bos=2))
    runs = []
    for _ in range(1 + args.repeats):
        clock = Clock()
        with torch.no_grad():
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 do_sample=False, streamer=clock)
            finished = time.perf_counter()
        first = clock.times[1]
        runs.append((first - started, finished - first, out[:, ids.shape[1]:].tolist()))
    return measured(runs[1:], args, runs[0][0] + runs[0][1])


def measured(runs, args, warmup_s: float) -> dict:
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    lengths = {len(row) for r in runs for row in r[2]}
    return {"prefill_s": prefill, "decode_s": decode,
            "prefill_tokens_per_s": args.batch * args.prompt / prefill,
            "decode_tokens_per_s": args.batch * (args.new - 1) / decode,
            "prefill_runs_s": [round(r[0], 4) for r in runs], "decode_runs_s": [round(r[1], 4) for r in runs],
            "first_call_s": warmup_s, "new_tokens": sorted(lengths), "tokens_sha": digest(runs[-1][2]),
            "peak_rss_bytes": common.peak_rss_bytes(), "versions": common.versions()}


def summarise(records: list[dict], args) -> list[dict]:
    out = []
    for batch in args.batches:
        mine = [r for r in records if r.get("batch") == batch and "decode_s" in r]
        ours = [r for r in mine if r["peer"] == "ours"]
        theirs = [r for r in mine if r["peer"] == "transformers"]
        row = {"bench": "generate", "summary": True, "batch": batch, "prompt": args.prompt, "new": args.new}
        for name, group in (("ours", ours), ("transformers", theirs)):
            row[f"{name}_prefill_tokens_per_s"] = common.median(r["prefill_tokens_per_s"] for r in group)
            row[f"{name}_decode_tokens_per_s"] = common.median(r["decode_tokens_per_s"] for r in group)
        for phase in ("prefill", "decode"):
            row[f"{phase}_speedup"] = common.ratio(row[f"ours_{phase}_tokens_per_s"],
                                                    row[f"transformers_{phase}_tokens_per_s"])
        row["same_tokens"] = bool(ours and theirs) and len({r["tokens_sha"] for r in ours + theirs}) == 1
        out.append(common.round_floats(row, 3))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per (peer, batch), alternating")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", help="float32 HF folder (default: tests/real_gemma.py's reference folder)")
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    folder = args.folder
    if folder is None:
        sys.path.insert(0, os.path.join(common.ROOT, "tests"))
        from real_gemma import reference_folder

        folder = reference_folder()
    if args.child:
        run = child_ours if args.child == "ours" else child_transformers
        print(json.dumps(run(args, folder), default=str))
        return
    peers = [p for p in args.peers.split(",") if p]
    records = []
    for round_index in range(args.rounds):
        for batch in args.batches:
            order = peers if round_index % 2 == 0 else peers[::-1]
            for peer in order:
                command = [sys.executable, os.path.abspath(__file__), "--child", peer, "--batch", str(batch),
                           "--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats),
                           "--seed", str(args.seed), "--folder", folder]
                record = common.run_child(command, timeout=args.timeout)
                record.update(bench="generate", peer=peer, batch=batch, prompt=args.prompt, new=args.new,
                              round=round_index)
                common.emit(common.round_floats(record, 4), args.out)
                records.append(record)
    for row in summarise(records, args):
        common.emit(row, args.out)


if __name__ == "__main__":
    main()
