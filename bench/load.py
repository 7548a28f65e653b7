"""Loading a checkpoint into memory on CPU: ours vs transformers `from_pretrained` vs Tunix's safetensors loader.

    python bench/load.py --shape gemma-2-2b                      # makes bench/out/ckpt/gemma-2-2b once, then measures
    python bench/load.py --checkpoint DIR --peers ours,torch --repeats 3 --cache warm,cold --layouts hub

Each peer loads in its own fresh process (peak RSS is per process), peers alternate within each repeat, and the
same dtype as the checkpoint (bf16) is kept by all. Timed: from the call into the loader (imports done) until every
parameter is materialised in memory. Peak RSS is the whole process's `ru_maxrss` (runtime included).

Cache states: `warm` reads the files once before the repeats (every run then reads from the page cache, so the
figure is the loader's own cost); `cold` evicts the checkpoint's files from the page cache (posix_fadvise
DONTNEED on those files only) before every run, so the disk is read each time.

File layouts (`--layouts`, both by default): "aligned" is the checkpoint as our writer lays it out (tensor data
64-byte aligned in the file, so our loader maps it without copying); "hub" is the same tensors as the safetensors
library, transformers and the Hub write them (header padded to 8 bytes, tensors sorted by name) with data *not*
64-byte aligned, as 7 Hub files in 8 are: our loader must copy those bytes. The layout the given checkpoint is not
in is made once beside it under bench/out/ckpt (`make_checkpoint.copy_with_layout`, a kernel-side copy).

Prints one JSON line per run, then one summary line per (layout, cache state) with medians and same-run ratios.
Target, in both layouts: ours faster than every peer; ours' peak RSS <= 1.15x the checkpoint's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PEERS = ("ours", "torch", "tunix")
RSS_TARGET = 1.15


def child_ours(folder: str, dtype: str | None) -> dict:
    import jax
    from flax import nnx

    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    jax.devices()  # start the runtime outside the timed part, as the peers' imports do
    rss_before = common.current_rss_bytes()
    start = time.perf_counter()
    model = load_pretrained(folder, dtype=dtype)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"peer": "ours", "load_s": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
            "rss_before_load_bytes": rss_before, "parameters": int(params), "versions": common.versions()}


def peer_command(peer: str, folder: str, dtype: str) -> list[str]:
    if peer == "ours":
        return [sys.executable, os.path.abspath(__file__), "--child", peer, "--checkpoint", folder, "--dtype", dtype]
    if peer == "torch":
        return [sys.executable, os.path.join(common.BENCH, "peers", "torch_peer.py"), "load", folder,
                "--dtype", dtype]
    from tunix_env import ensure_tunix_python

    return [ensure_tunix_python(), os.path.join(common.BENCH, "peers", "tunix_peer.py"), "load", folder,
            "--dtype", dtype]


def checkpoint_dtype(folder: str) -> str:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("dtype") or config.get("torch_dtype") or "bfloat16"


def measure(folder: str, layout: str, peers: list[str], repeats: int, caches: list[str], out: str | None,
            timeout: float) -> list[dict]:
    from make_checkpoint import data_start

    files = common.safetensors_files(folder)
    starts = sorted({data_start(path) % 64 for path in files})
    size = common.checkpoint_bytes(folder)
    dtype = checkpoint_dtype(folder)
    commands = {peer: peer_command(peer, folder, dtype) for peer in peers}
    summaries = []
    for cache in caches:
        if cache == "warm":
            common.read_files_sequentially(files)
        runs: dict[str, list[dict]] = {peer: [] for peer in peers}
        for repeat in range(repeats):
            order = peers[repeat % len(peers):] + peers[:repeat % len(peers)]  # rotate who goes first
            for peer in order:
                if cache == "cold":
                    common.evict_from_page_cache(files)
                record = common.run_child(commands[peer], timeout=timeout)
                record.update(bench="load", peer=peer, cache=cache, layout=layout, repeat=repeat,
                              checkpoint_bytes=size, checkpoint=os.path.basename(os.path.normpath(folder)),
                              data_start_mod_64=starts)
                if "peak_rss_bytes" in record:
                    record["peak_rss_over_checkpoint"] = record["peak_rss_bytes"] / size
                common.emit(common.round_floats(record), out)
                runs[peer].append(record)
        summary = summarise(runs, cache, size, folder)
        summary.update(layout=layout, data_start_mod_64=starts)
        summaries.append(common.emit(summary, out))
    return summaries


def summarise(runs: dict[str, list[dict]], cache: str, size: int, folder: str) -> dict:
    summary = {"bench": "load", "summary": True, "cache": cache, "checkpoint_bytes": size,
               "checkpoint": os.path.basename(os.path.normpath(folder))}
    for peer, records in runs.items():
        ok = [r for r in records if "load_s" in r]
        summary[f"{peer}_load_s"] = common.median(r["load_s"] for r in ok)
        summary[f"{peer}_peak_rss_gib"] = common.median(r["peak_rss_bytes"] / common.GIB for r in ok)
        summary[f"{peer}_rss_growth_over_checkpoint"] = common.median(
            (r["peak_rss_bytes"] - r["rss_before_load_bytes"]) / size for r in ok)
        summary[f"{peer}_runs"] = len(ok)
        if len(ok) < len(records):
            summary[f"{peer}_errors"] = [r.get("error") for r in records if "load_s" not in r]
    ours = runs.get("ours", [])
    for peer in runs:
        if peer == "ours":
            continue
        pairs = [(o["load_s"], p["load_s"]) for o, p in zip(ours, runs[peer]) if "load_s" in o and "load_s" in p]
        summary[f"speedup_vs_{peer}"] = common.median(p / o for o, p in pairs)  # per-repeat ratios, median
    if ours and summary.get("ours_peak_rss_gib") is not None:
        ratio = summary["ours_peak_rss_gib"] * common.GIB / size
        summary["ours_peak_rss_over_checkpoint"] = ratio
        summary["rss_target_met"] = ratio <= RSS_TARGET
        speedups = [v for k, v in summary.items()
                    if k.startswith("speedup_vs_") and v is not None]
        summary["speed_target_met"] = bool(speedups) and all(v > 1.0 for v in speedups)
    return common.round_floats(summary)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="an HF checkpoint folder (default: make --shape's under bench/out)")
    parser.add_argument("--shape", default="gemma-2-2b", help="make_checkpoint shape when --checkpoint is absent")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="warm,cold")
    parser.add_argument("--layouts", default="aligned,hub", help="file layouts to measure (see the docstring)")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--min-free-gib", type=float, default=14.0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child", choices=("ours",), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child_ours(args.checkpoint, args.dtype), default=str))
        return
    from make_checkpoint import ensure_checkpoint, ensure_layout, layout_of

    folder = args.checkpoint
    if not folder:
        folder = ensure_checkpoint(args.shape, os.path.join(common.CKPT_DIR, args.shape))
    folders = {}
    for layout in [name for name in args.layouts.split(",") if name]:
        if layout not in ("aligned", "hub"):
            raise SystemExit(f"--layouts: unknown layout {layout!r}; use aligned and/or hub.")
        if layout_of(folder) == layout:
            folders[layout] = folder
        elif not args.checkpoint and layout == "aligned":  # a checkpoint made before our writer aligned data
            folders[layout] = ensure_layout(folder, folder, layout)
        else:
            name = os.path.basename(os.path.normpath(folder)).removesuffix("-hub").removesuffix("-aligned")
            folders[layout] = ensure_layout(folder, os.path.join(common.CKPT_DIR, f"{name}-{layout}"), layout)
    for layout, path in folders.items():
        common.wait_for_memory(args.min_free_gib)
        measure(path, layout, [p for p in args.peers.split(",") if p], args.repeats,
                [c for c in args.cache.split(",") if c], args.out, args.timeout)


if __name__ == "__main__":
    main()
