"""A run's GGUF in llama.cpp against the run's own continuations: the first N held-out prompts of the run's
suite.json, continued greedily by llama.cpp (llama-cpp-python, `make llama-cpp`) from the exported GGUF, beside the
distilled student's continuation the run made in JAX. A q8_0 file rounds the weights, so near-tied greedy choices
may part; the record says where each pair parts.

    python bench/llama_cpp_continuations.py --gguf runs/x/student-q8_0.gguf --suite runs/x/suite.json \\
        --out bench/results/demo-tpu-v5e/llama_cpp.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

MODEL = "distilled student"


def common_prefix(a: str, b: str) -> int:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return size


def continue_prompts(gguf: str, samples: list[dict], new_tokens: int) -> list[dict]:
    import llama_cpp

    model = llama_cpp.Llama(model_path=gguf, verbose=False, n_ctx=512, n_threads=os.cpu_count() or 2)
    rows = []
    for sample in samples:
        started = time.perf_counter()
        out = model.create_completion(sample["prompt"], max_tokens=new_tokens, temperature=0.0, top_k=1)
        theirs, ours = out["choices"][0]["text"], sample["continuations"][MODEL]
        same = common_prefix(theirs, ours)
        rows.append({"line": sample.get("line"), "llama_cpp": theirs, "ours": ours, "same_chars": same,
                     "ours_chars": len(ours), "identical": theirs == ours,
                     "s": round(time.perf_counter() - started, 1)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--suite", required=True, help="the run's suite.json (its samples and settings)")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.suite) as handle:
        suite = json.load(handle)
    new_tokens = int(suite.get("settings", {}).get("new_tokens", 48))
    rows = continue_prompts(args.gguf, suite["samples"][:args.count], new_tokens)
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)
    print(f"{sum(r['identical'] for r in rows)} of {len(rows)} continuations identical to the run's own; the others "
          f"part after {sorted(r['same_chars'] for r in rows if not r['identical'])} characters")


if __name__ == "__main__":
    main()
