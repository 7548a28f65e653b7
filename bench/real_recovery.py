"""Recovery curves on the real Gemma 3 270M: one pruned student, several training recipes, equal tokens.

    python bench/real_recovery.py --teacher FOLDER --student layers=18,mlp=512 --run kl --run ce --steps 24

Each `--run` names a recipe (see RECIPES); every run starts from the same pruned student, sees the same batches
in the same order, and is evaluated on the same held-out stdlib modules every `--eval-every` steps (held-out
cross-entropy, top-1 agreement with the teacher, KL(teacher || student)). One JSON line per evaluation goes to
stdout (and `--out`), so the curves can be drawn and compared until they cross or flatten.
"""
from __future__ import annotations

import argparse
import copy
import shutil
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import distill  # noqa: E402
import surgery  # noqa: E402

# name -> (loss weights, temperature, learning-rate multiplier, trainable patterns or None)
RECIPES = {
    "kl": (dict(kl=1.0), 1.0, 1.0, None),
    "ce": (dict(kl=0.0, ce=1.0), 1.0, 1.0, None),
    "mix": (dict(kl=0.5, ce=0.5), 1.0, 1.0, None),
    "mix_t2": (dict(kl=0.5, ce=0.5), 2.0, 1.0, None),
    "kl_t2": (dict(kl=1.0), 2.0, 1.0, None),
    "mix_feat": (dict(kl=0.5, ce=0.5, feature=0.1), 1.0, 1.0, None),
    "kl_feat": (dict(kl=1.0, feature=0.1), 1.0, 1.0, None),
    "mix_noemb": (dict(kl=0.5, ce=0.5), 1.0, 1.0, "frozen:embed_tokens"),
    "kl_noemb": (dict(kl=1.0), 1.0, 1.0, "frozen:embed_tokens"),
    "ce_noemb": (dict(kl=0.0, ce=1.0), 1.0, 1.0, "frozen:embed_tokens"),
    "mix_lr3": (dict(kl=0.5, ce=0.5), 1.0, 3.0, None),
    "ce_lr3": (dict(kl=0.0, ce=1.0), 1.0, 3.0, None),
    "kl_lr3": (dict(kl=1.0), 1.0, 3.0, None),
    "mixf_noemb": (dict(kl=0.5, ce=0.5, feature=1.0), 1.0, 1.0, "frozen:embed_tokens"),
    "klf_noemb": (dict(kl=1.0, feature=1.0), 1.0, 1.0, "frozen:embed_tokens"),
    "f_noemb": (dict(kl=0.0, feature=1.0), 1.0, 1.0, "frozen:embed_tokens"),
    "mixt2_noemb": (dict(kl=0.5, ce=0.5), 2.0, 1.0, "frozen:embed_tokens"),
}


def parse_shape(text: str, teacher: surgery.GemmaConfig) -> surgery.StudentSpec:
    values = dict(item.split("=") for item in text.split(","))
    return surgery.StudentSpec(int(values.get("layers", teacher.num_hidden_layers)),
                               int(values.get("hidden", teacher.hidden_size)),
                               int(values.get("mlp", teacher.intermediate_size)),
                               int(values.get("heads", teacher.num_attention_heads)),
                               int(values.get("kv_heads", teacher.num_key_value_heads)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", default="layers=18,mlp=512")
    p.add_argument("--run", action="append", default=[], help="RECIPE[@LR], RECIPE from RECIPES")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=6)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--out")
    args = p.parse_args()
    out = open(args.out, "a") if args.out else None

    setup = (f"Student {args.student} of the teacher, cut by plan_student with calibration; batch {args.batch_size} x "
             f"{args.seq_len}, cosine learning rate over {args.steps} steps (2 warm-up), the same batches in the same "
             f"order for every recipe; held-out CE on {args.eval_batches} batches of held-out stdlib modules.")

    def emit(record):
        if "run" in record:
            record = {"bench": "recovery", "series": record.pop("run"), "setup": setup, **record}
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    teacher = surgery.load_pretrained(args.teacher, dtype="float32")
    files = distill.stdlib_corpus(args.corpus_bytes, seed=0)
    data = distill.TokenBatches.from_files(files, args.teacher, batch_size=args.batch_size, seq_len=args.seq_len,
                                           seed=0, eval_batch_size=args.batch_size)
    evals = data.eval_batches()[: args.eval_batches]
    spec = parse_shape(args.student, teacher.config)
    start = time.perf_counter()
    plan = surgery.plan_student(teacher, spec, calibration=data.calibration_ids(64, seed=0), seed=0)
    emit({"event": "plan", "seconds": round(time.perf_counter() - start, 1), "student": args.student,
          "non_embedding": spec_params(surgery.apply_plan(teacher, plan).config)})
    emit({"event": "teacher", **scores(teacher, teacher, evals)})
    emit({"event": "pruned", **scores(surgery.apply_plan(teacher, plan), teacher, evals)})
    for name in args.run:
        recipe, _, lr_text = name.partition("@")
        weights, temperature, lr_mult, trainable = RECIPES[recipe]
        lr = float(lr_text) if lr_text else args.lr * lr_mult
        student = surgery.apply_plan(teacher, plan)
        run_data = copy.deepcopy(data)  # every recipe sees the same batches from the start
        shutil.rmtree(f"/tmp/recovery-ckpt/{name.replace('@', '_')}", ignore_errors=True)
        emit({"run": name, "step": 0, **scores(student, teacher, evals)})
        done = 0
        while done < args.steps:
            chunk = min(args.eval_every, args.steps - done)
            frozen = [trainable.split(":", 1)[1] + "*"] if trainable else None
            stage = distill.Stage(steps=args.steps, learning_rate=lr, warmup_steps=2,
                                  weights=distill.LossWeights(**weights), temperature=temperature,
                                  frozen=frozen)
            config = distill.DistillConfig(stages=(stage,), batch_size=args.batch_size, seq_len=args.seq_len,
                                           plan=plan, progress=False, plots=False, eval_every=10**9,
                                           eval_batches=1, halt_after=done + chunk, seed=0,
                                           checkpoint=distill.CheckpointConfig(
                                               directory=f"/tmp/recovery-ckpt/{name.replace('@', '_')}", every=chunk))
            t0 = time.perf_counter()
            result = distill.run(teacher if any(weights.get(k) for k in ("kl", "feature")) else None,
                                 student, run_data, config)
            student, done = result.student, result.steps
            emit({"run": name, "step": done, "train_s": round(time.perf_counter() - t0, 1),
                  "tokens": done * args.batch_size * args.seq_len, **scores(student, teacher, evals)})


def spec_params(config) -> int:
    return config.num_parameters() - config.vocab_size * config.hidden_size


def scores(model, teacher, evals) -> dict:
    from distill.evaluate import heldout_loss
    return {"ce": round(heldout_loss(model, evals)["loss"], 4)}


if __name__ == "__main__":
    main()
