"""lm-eval requests per second, ours (`nnx-surgery`) against lm-eval's own `hf` backend, on the same folder and CPU.

    python bench/lm_eval_speed.py                         # the tiny random Gemma 3 of tests/evaluation/test_lm_eval_backend.py
    python bench/lm_eval_speed.py --model real            # the real Gemma 3 270M (float32 import of the GGUF)
    python bench/lm_eval_speed.py --model real --loglikelihood 64 --generate 16 --batch 8

Requests come from the offline tasks (nnx_surgery.evaluation.lm_eval_tasks): `loglikelihood` are the multiple-choice task's
(context, choice) pairs, `generate_until` the completion task's (greedy, until "\\n", at most 24 new tokens). Both
peers get the same requests, batch size and float32 weights, `--passes` times: the first pass is cold (our
compilations, torch's first calls), the last warm; both are reported. Peers run one after the other in this process
(never side by side), so the machine's noise shows as run-to-run spread: quote ratios from one run. One JSON line
per (peer, kind), then a markdown table. The answers are compared too (`max_abs_diff`, `same_text`). `--record
PATH` appends the run's summary (rates, ratios, agreement) as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_folder(kind: str, work: str) -> str:
    if kind == "real":
        from real_gemma import cached_import
        return cached_import("float32")
    from hf_reference import make_hf_model, save_hf
    from tiny_tokenizers import SAVERS
    folder = os.path.join(work, "tiny")
    size = SAVERS["gemma"](folder)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size), folder)
    return folder


def requests(folder: str, loglikelihood: int, generate: int) -> dict[str, list]:
    """{kind: requests} as lm-eval Instances."""
    from lm_eval.api.instance import Instance
    from nnx_surgery.evaluation.lm_eval_tasks import completion_docs, next_line_docs

    pairs = [(doc["context"], choice) for doc in next_line_docs() for choice in doc["choices"]]
    settings = {"until": ["\n"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0}
    prompts = [(doc["context"], dict(settings)) for doc in completion_docs()]
    return {"loglikelihood": [Instance("loglikelihood", {}, args, i) for i, args in enumerate(pairs)][:loglikelihood],
            "generate_until": [Instance("generate_until", {}, args, i) for i, args in enumerate(prompts)][:generate]}


def make_peer(name: str, folder: str, batch: int):
    import nnx_surgery.evaluation.lm_eval_backend  # noqa: F401  (registers nnx-surgery)
    from lm_eval.api.registry import get_model
    args = dict(pretrained=folder, dtype="float32", batch_size=batch)
    return get_model(name)(**args, **({"device": "cpu"} if name == "hf" else {}))


def run(name: str, lm, work: dict, passes: int) -> dict:
    """Each kind's requests `passes` times: the first pass is cold (our compilations, torch's first calls), the
    last one warm; requests/s of both."""
    answers, lines = {}, []
    for kind, timed in work.items():
        if not timed:
            continue
        seconds = []
        for _ in range(passes):
            started = time.perf_counter()
            answers[kind] = getattr(lm, kind)(timed)
            seconds.append(time.perf_counter() - started)
        lines.append({"peer": name, "kind": kind, "requests": len(timed), "cold_s": round(seconds[0], 3),
                      "warm_s": round(seconds[-1], 3), "cold_per_s": round(len(timed) / seconds[0], 3),
                      "warm_per_s": round(len(timed) / seconds[-1], 3)})
        print(json.dumps(lines[-1]), flush=True)
    return {"lines": lines, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--loglikelihood", type=int, default=256, help="timed loglikelihood requests")
    parser.add_argument("--generate", type=int, default=32, help="timed generate_until requests")
    parser.add_argument("--passes", type=int, default=2, help="passes over the requests; the first is cold")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--peers", default="nnx-surgery,hf")
    parser.add_argument("--record", default="", help="append the run's summary to this JSONL (e.g. "
                        "bench/results/lm-eval-speed.jsonl, which BENCHMARKS.md's section reads)")
    parser.add_argument("--scoring", default="", help="a note on our scoring code for the record (what changed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        folder = model_folder(args.model, work_dir)
        work = requests(folder, args.loglikelihood, args.generate)
        results = {}
        for name in args.peers.split(","):
            lm = make_peer(name, folder, args.batch)
            results[name] = run(name, lm, work, args.passes)
            del lm
    report(results, args)


def summary(results: dict, args) -> dict:
    """Per kind: both peers' request rates, ours over the last peer's (warm, cold), and how their answers agree."""
    peers = list(results)
    kinds = []
    for index, line in enumerate(results[peers[0]]["lines"]):
        kind = line["kind"]
        rows = [results[p]["lines"][index] for p in peers]
        a, b = (results[p]["answers"][kind] for p in (peers[0], peers[-1]))
        if kind == "loglikelihood":
            agreement = {"max_abs_diff": max(abs(x[0] - y[0]) for x, y in zip(a, b)),
                         "greedy_flags_equal": [x[1] for x in a] == [y[1] for y in b]}
        else:
            agreement = {"same_text": sum(x == y for x, y in zip(a, b)), "of": len(a)}
        kinds.append({"kind": kind, "requests": line["requests"], "peers": rows, "agreement": agreement,
                      "ratio_warm": rows[0]["warm_per_s"] / rows[-1]["warm_per_s"],
                      "ratio_cold": rows[0]["cold_per_s"] / rows[-1]["cold_per_s"]})
    record = {"bench": "lm_eval_speed", "model": args.model, "batch": args.batch, "passes": args.passes,
              "peers": peers, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "kinds": kinds}
    return {**record, "scoring": args.scoring} if getattr(args, "scoring", "") else record


def table(record: dict) -> list[str]:
    """The Markdown table of one `summary` record (BENCHMARKS.md prints it the same way)."""
    peers = record["peers"]
    out = ["| requests | " + " | ".join(f"{p} req/s cold / warm" for p in peers) + " | ratio warm (cold) | agreement |",
           "|---|" + "---|" * (len(peers) + 2)]
    for entry in record["kinds"]:
        agree = entry["agreement"]
        if entry["kind"] == "loglikelihood":
            text = (f"max abs(d logp) {agree['max_abs_diff']:.1e}, greedy flags "
                    f"{'equal' if agree['greedy_flags_equal'] else 'DIFFER'}")
        else:
            text = f"{agree['same_text']}/{agree['of']} texts equal"
        rates = " | ".join(f"{r['cold_per_s']:.2f} / {r['warm_per_s']:.2f}" for r in entry["peers"])
        out.append(f"| {entry['requests']} {entry['kind']} | {rates} | {entry['ratio_warm']:.2f}x "
                   f"({entry['ratio_cold']:.2f}x) | {text} |")
    return out


def report(results: dict, args) -> None:
    record = summary(results, args)
    print(f"\n{args.model} model, batch {args.batch}, float32, {os.cpu_count()} CPUs\n")
    print("\n".join(table(record)))
    if args.record:
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
