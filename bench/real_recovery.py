"""Recovery on the real Gemma 3 270M: one pruned student, several training recipes, the same batches, judged on an
in-domain and a general-domain held-out set.

    python bench/real_recovery.py --student layers=18,mlp=512 --run kl_noemb --run ce_noemb \
        --steps 24 --eval-at 12,24 --out bench/results/recovery.jsonl
    python bench/real_recovery.py ... --general-mix 0.25 --teacher-correction 12   # corpus mix, teacher correction

Each `--run` is RECIPE[@LR] (RECIPES below; LR overrides the recipe's learning rate). Every run starts from the
same pruned student, sees the same batches in the same order, and is scored at each `--eval-at` step on the same
two `evaluation.HeldoutSet`s: held-out stdlib modules (in-domain) and the held-out half of the pydoc topics (English
prose no training corpus contains), each `--eval-tokens` tokens: CE per token and per byte, KL(teacher ||
student), top-1 agreement, and the per-passage NLL sums, so any two runs can be compared with a paired bootstrap
(`evaluation.paired_interval`). `--general-mix F` makes about F of the training text general prose (the pydoc
topics' `train` part, repeated; disjoint from the held-out half, never held out itself); `--teacher-correction N`
fine-tunes the teacher with plain CE on the corpus for N steps before it is pruned and teaches. One JSON line per
record goes to stdout (and `--out`); each record carries its setup, from which `command_line` rebuilds the command
(BENCHMARKS.md prints it under each table).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nnx_surgery import distill, evaluation  # noqa: E402
from nnx_surgery import surgery  # noqa: E402
from nnx_surgery.model_inputs import teacher_folder  # noqa: E402

# name -> loss weights, temperature, learning-rate multiplier, frozen patterns
RECIPES = {
    "kl": (dict(kl=1.0), 1.0, 1.0, None),
    "ce": (dict(kl=0.0, ce=1.0), 1.0, 1.0, None),
    "mix": (dict(kl=0.5, ce=0.5), 1.0, 1.0, None),
    "mix_feat": (dict(kl=0.5, ce=0.5, feature=0.1), 1.0, 1.0, None),
    "kl_noemb": (dict(kl=1.0), 1.0, 1.0, ["embed_tokens*"]),  # Minitron: logit-only forward KL, tau 1, no CE
    "ce_noemb": (dict(kl=0.0, ce=1.0), 1.0, 1.0, ["embed_tokens*"]),  # the control's loss
    "mix_noemb": (dict(kl=0.5, ce=0.5), 1.0, 1.0, ["embed_tokens*"]),
    "mixf_noemb": (dict(kl=0.5, ce=0.5, feature=1.0), 1.0, 1.0, ["embed_tokens*"]),  # the demo's loss until now
    "klf_noemb": (dict(kl=1.0, feature=1.0), 1.0, 1.0, ["embed_tokens*"]),
    "kl_t2_noemb": (dict(kl=1.0), 2.0, 1.0, ["embed_tokens*"]),
}


def parse_shape(text: str, teacher) -> surgery.StudentSpec:
    """`--student` as the recipe reads it (`StudentSpec.from_text`); this harness scores every arm in the teacher's
    tokens, so a trimmed vocabulary is refused (the recipe judges those)."""
    spec = surgery.StudentSpec.from_text(text, teacher)
    if spec.vocab_size is not None:
        raise surgery.SpecError(f"--student {text!r}: real_recovery keeps the teacher's vocabulary; drop vocab= "
                                "(recipes/gemma_7b_to_2b.py trims it and judges the student per byte).")
    return spec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="gguf:gemma3-270m",
                   help="the teacher: gguf:gemma3-270m (the real model, from its package; default), a .gguf file or "
                        "an HF folder")
    p.add_argument("--student", default="layers=18,mlp=512")
    p.add_argument("--run", action="append", default=[], help="RECIPE[@LR], RECIPE from RECIPES")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eval-at", default="", help="steps to score the held-out sets at (default: the last)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--general-mix", type=float, default=0.0, help="share of general prose in the training text")
    p.add_argument("--teacher-correction", type=int, default=0, help="CE steps on the teacher before pruning")
    p.add_argument("--teacher-correction-lr", type=float, default=3e-5)
    p.add_argument("--no-restart", action="store_true", help="rows that continue a document start without BOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="a label for this invocation's records")
    p.add_argument("--out")
    return p.parse_args(argv)


def setup_of(args: argparse.Namespace) -> dict:
    """What every record of one invocation shares: the flags that decide the pruned student, the batches, the
    teacher and the held-out sets (the arms and `--eval-at` aside)."""
    return {"student": args.student, "steps": args.steps, "batch": f"{args.batch_size}x{args.seq_len}",
            "lr": args.lr, "warmup": args.warmup, "corpus_bytes": args.corpus_bytes,
            "general_mix": args.general_mix, "restart_rows": not args.no_restart,
            "teacher_correction": args.teacher_correction, "teacher_correction_lr": args.teacher_correction_lr,
            "seed": args.seed, "eval_tokens": args.eval_tokens, "tag": args.tag}


def command_line(setup: dict, runs: list[str], eval_at: list[int] = ()) -> str:
    """The command that makes `runs` of `setup` again (a record's setup: keys missing from older records take
    today's defaults)."""
    setup = {**setup_of(parse_args([])), **setup}  # the tag, a label, is left out
    batch_size, seq_len = setup["batch"].split("x")
    words = ["python bench/real_recovery.py", f"--student {setup['student']}",
             f"--steps {setup['steps']}", f"--batch-size {batch_size}", f"--seq-len {seq_len}",
             f"--lr {setup['lr']:g}", f"--warmup {setup['warmup']}", f"--corpus-bytes {setup['corpus_bytes']}",
             f"--general-mix {setup['general_mix']:g}", f"--seed {setup['seed']}",
             f"--eval-tokens {setup['eval_tokens']}"]
    if setup["teacher_correction"]:
        words += [f"--teacher-correction {setup['teacher_correction']}",
                  f"--teacher-correction-lr {setup['teacher_correction_lr']:g}"]
    if not setup["restart_rows"]:
        words.append("--no-restart")
    if eval_at:
        words.append(f"--eval-at {','.join(str(step) for step in eval_at)}")
    return " ".join(words + [f"--run {run}" for run in runs])


def main(argv=None) -> None:
    args = parse_args(argv)
    args.teacher = teacher_folder(args.teacher, None)  # the real model's GGUF: imported once, cached
    out = open(args.out, "a") if args.out else None
    setup = setup_of(args)

    def emit(record):
        line = json.dumps({"bench": "recovery2", **setup, **record})
        print(line[:400], flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    teacher = surgery.load_pretrained(args.teacher, dtype="float32")
    files = distill.stdlib_corpus(args.corpus_bytes, seed=args.seed)
    mix = distill.general_mix(sum(os.path.getsize(f) for f in files), args.general_mix)
    restart = None if args.no_restart else distill.load_tokenizer(args.teacher).bos_id
    data = distill.TokenBatches.from_files(files, args.teacher, batch_size=args.batch_size, seq_len=args.seq_len,
                                           seed=args.seed, eval_batch_size=args.batch_size, extra_train=mix,
                                           restart_id=restart)
    sets = [evaluation.HeldoutSet.from_texts("in-domain", data.eval_texts(), args.teacher, seq_len=args.seq_len,
                                          max_tokens=args.eval_tokens, seed=args.seed),
            evaluation.HeldoutSet.from_texts("general", distill.general_prose("heldout"), args.teacher,
                                          seq_len=args.seq_len, max_tokens=args.eval_tokens, seed=args.seed)]
    if args.teacher_correction:
        started = time.perf_counter()
        teacher = train(None, teacher, copy.deepcopy(data), args, dict(kl=0.0, ce=1.0), 1.0,
                        args.teacher_correction_lr, ["embed_tokens*"], args.teacher_correction, None)
        emit({"event": "teacher_correction", "seconds": round(time.perf_counter() - started, 1)})
    plan = surgery.plan_student(teacher, parse_shape(args.student, teacher.config),
                                calibration=data.calibration_ids(64, seed=args.seed), seed=args.seed)
    teacher_hidden: dict = {}  # the teacher no longer changes: its hidden states on each set are computed once
    first = scores({"teacher": teacher, "s": surgery.apply_plan(teacher, plan)}, sets, teacher_hidden)
    emit({"event": "teacher", **first["teacher"]})
    emit({"event": "pruned", **first["s"]})
    eval_at = sorted({int(s) for s in args.eval_at.split(",") if s} | {args.steps})
    for name in args.run:
        recipe, _, lr_text = name.partition("@")
        weights, temperature, lr_mult, frozen = RECIPES[recipe]
        lr = float(lr_text) if lr_text else args.lr * lr_mult
        student, run_data, done = surgery.apply_plan(teacher, plan), copy.deepcopy(data), 0
        with tempfile.TemporaryDirectory() as checkpoints:
            for stop in eval_at:
                started = time.perf_counter()
                uses_teacher = any(weights.get(k) for k in ("kl", "feature"))
                student = train(teacher if uses_teacher else None, student, run_data, args, weights, temperature,
                                lr, frozen, args.steps, plan, halt_after=stop, checkpoints=checkpoints)
                done, seconds = stop, round(time.perf_counter() - started, 1)
                emit({"run": name, "step": done, "train_s": seconds, "tokens": done * args.batch_size * args.seq_len,
                      **scores({"teacher": teacher, "s": student}, sets, teacher_hidden)["s"]})


def train(teacher, student, data, args, weights, temperature, lr, frozen, steps, plan, *, halt_after=None,
          checkpoints=None):
    """`steps` of one stage (cosine schedule over all of them), stopped after `halt_after`; a later call with the
    same `checkpoints` folder resumes it."""
    stage = distill.Stage(steps=steps, learning_rate=lr, warmup_steps=min(args.warmup, steps - 1),
                          weights=distill.LossWeights(**weights), temperature=temperature, frozen=frozen)
    folder = checkpoints or tempfile.mkdtemp()
    # the bar (stderr; stdout carries the records) shows the minutes a real-model arm spends training
    config = distill.DistillConfig(stages=(stage,), batch_size=args.batch_size, seq_len=args.seq_len, plan=plan,
                                   progress=True, plots=False, eval_every=10**9, eval_batches=1,
                                   halt_after=halt_after, seed=args.seed,
                                   checkpoint=distill.CheckpointConfig(directory=folder, every=steps))
    result = distill.run(teacher, student, data, config)
    if checkpoints is None:
        shutil.rmtree(folder, ignore_errors=True)
    return result.student


def progress(line: str) -> None:
    """A progress line on stderr (stdout carries the records)."""
    print(line, file=sys.stderr, flush=True)


def scores(models: dict, sets, teacher_hidden: dict | None = None) -> dict:
    """Per model: each set's CE, CE per byte, KL, top-1 agreement and per-passage NLL sums (for paired tests).
    `teacher_hidden`: `score_heldout`'s reference cache, kept across calls while the teacher is unchanged."""
    found: dict = {name: {} for name in models}
    for held in sets:
        per = evaluation.score_heldout(models, held, reference="teacher", log=progress, reference_cache=teacher_hidden)
        for name in models:
            summary = evaluation.summarise(per[name], held)
            found[name][held.name] = {"ce": round(summary["ce"], 4), "ce_per_byte": round(summary["ce_per_byte"], 4),
                                      "kl": round(summary["kl"], 4),
                                      "top1": round(summary["top1_agreement"], 4), "tokens": summary["tokens"],
                                      "passage_nll": [round(x, 3) for x in per[name]["nll"].tolist()],
                                      "passage_kl": [round(x, 3) for x in per[name]["kl"].tolist()],
                                      "passage_tokens": [int(x) for x in per[name]["tokens"].tolist()],
                                      "passage_documents": [int(x) for x in held.documents.tolist()]}
    return found


if __name__ == "__main__":
    main()
