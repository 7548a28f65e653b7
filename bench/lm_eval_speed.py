"""lm-eval requests per second, ours (`nnx-surgery`) against lm-eval's own `hf` backend, on the same folder and CPU.

    python bench/lm_eval_speed.py                         # the tiny random Gemma 3 of tests/test_lm_eval_backend.py
    python bench/lm_eval_speed.py --model real            # the real Gemma 3 270M (float32 import of the GGUF)
    python bench/lm_eval_speed.py --model real --loglikelihood 64 --generate 16 --batch 8

Requests come from the offline tasks (nnx_surgery.lm_eval_tasks): `loglikelihood` are the multiple-choice task's
(context, choice) pairs, `generate_until` the completion task's (greedy, until "\\n", at most 24 new tokens). Both
peers get the same requests, batch size and float32 weights, `--passes` times: the first pass is cold (our
compilations, torch's first calls), the last warm; both are reported. Peers run one after the other in this process
(never side by side), so the machine's noise shows as run-to-run spread: quote ratios from one run. One JSON line
per (peer, kind), then a markdown table. The answers are compared too (`max_abs_diff`, `same_text`).
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
    from nnx_surgery.lm_eval_tasks import completion_docs, next_line_docs

    pairs = [(doc["context"], choice) for doc in next_line_docs() for choice in doc["choices"]]
    settings = {"until": ["\n"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0}
    prompts = [(doc["context"], dict(settings)) for doc in completion_docs()]
    return {"loglikelihood": [Instance("loglikelihood", {}, args, i) for i, args in enumerate(pairs)][:loglikelihood],
            "generate_until": [Instance("generate_until", {}, args, i) for i, args in enumerate(prompts)][:generate]}


def make_peer(name: str, folder: str, batch: int):
    import nnx_surgery.lm_eval_backend  # noqa: F401  (registers nnx-surgery)
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


def report(results: dict, args) -> None:
    peers = list(results)
    print(f"\n{args.model} model, batch {args.batch}, float32, {os.cpu_count()} CPUs\n")
    print("| requests | " + " | ".join(f"{p} req/s cold / warm" for p in peers) +
          " | ratio warm (cold) | agreement |")
    print("|---|" + "---|" * (len(peers) + 2))
    for index, line in enumerate(results[peers[0]]["lines"]):
        kind = line["kind"]
        rows = [results[p]["lines"][index] for p in peers]
        a, b = (results[p]["answers"][kind] for p in (peers[0], peers[-1]))
        if kind == "loglikelihood":
            agreement = f"max |dlogp| {max(abs(x[0] - y[0]) for x, y in zip(a, b)):.1e}, " \
                        f"greedy flags {'equal' if [x[1] for x in a] == [y[1] for y in b] else 'DIFFER'}"
        else:
            agreement = f"{sum(x == y for x, y in zip(a, b))}/{len(a)} texts equal"
        warm, cold = (rows[0][key] / rows[-1][key] for key in ("warm_per_s", "cold_per_s"))
        rates = " | ".join(f"{r['cold_per_s']:.2f} / {r['warm_per_s']:.2f}" for r in rows)
        print(f"| {line['requests']} {kind} | {rates} | {warm:.2f}x ({cold:.2f}x) | {agreement} |")


if __name__ == "__main__":
    main()
