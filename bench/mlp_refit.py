"""The least-squares MLP refit on the real Gemma 3 270M: how near the teacher a cut student starts with and without
it, before any training.

    python bench/mlp_refit.py --student layers=18,mlp=768 --rows 64 --out bench/results/mlp-refit.jsonl

The student is cut from the teacher as the recipe cuts it (`plan_student` on 32 calibration rows of the demo's
training mix: half standard-library source, half general prose), once as sliced and once refitted
(`surgery.refit_mlp` on `--rows` other rows of the same mix, 256 tokens each). Both are scored with the teacher on
the same held-out passages (`--eval-tokens` teacher tokens each) of held-out standard-library modules (in-domain)
and held-out pydoc topics (general): CE per byte, KL(teacher || student), and the share of the sliced student's gap
to the teacher per byte that the refit closes. The teacher's vocabulary is kept (the refit does not depend on it).
One JSON line per record (stdout and `--out`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nnx_surgery import distill, evaluation  # noqa: E402
from nnx_surgery import surgery  # noqa: E402
from nnx_surgery.model_inputs import teacher_folder  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default="layers=18,mlp=768")
    p.add_argument("--rows", type=int, default=64, help="rows of 256 tokens the refit fits on")
    p.add_argument("--ridge", type=float, default=1e-2)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    folder = teacher_folder("gguf:gemma3-270m", None)
    teacher = surgery.load_pretrained(folder, dtype="float32")
    files = distill.stdlib_corpus(4_000_000, seed=0)
    mix = distill.general_mix(sum(os.path.getsize(f) for f in files), 0.5)
    data = distill.TokenBatches.from_files(files, folder, batch_size=4, seq_len=256, seed=0, eval_batch_size=4,
                                           extra_train=mix, restart_id=distill.load_tokenizer(folder).bos_id)
    sets = [evaluation.HeldoutSet.from_texts("in-domain", data.eval_texts(), folder, seq_len=256,
                                          max_tokens=args.eval_tokens, seed=0),
            evaluation.HeldoutSet.from_texts("general", distill.general_prose("heldout"), folder, seq_len=256,
                                          max_tokens=args.eval_tokens, seed=0)]
    spec = surgery.StudentSpec.from_text(args.student, teacher.config)
    plan = surgery.plan_student(teacher, spec, calibration=data.calibration_ids(32, seed=0), seed=0)
    sliced, refitted = surgery.apply_plan(teacher, plan), surgery.apply_plan(teacher, plan)
    report = surgery.refit_mlp(refitted, teacher, plan, data.calibration_ids(args.rows, seed=1), ridge=args.ridge)
    record = {"bench": "mlp_refit", "student": args.student, "rows": args.rows, "ridge": args.ridge,
              "eval_tokens": args.eval_tokens, "refit_s": round(report.seconds, 1),
              "layer_error": [[round(x.before, 4), round(x.after, 4)] for x in report.layers],
              "date": time.strftime("%Y-%m-%d"), "sets": {}}
    cache: dict = {}
    for held in sets:
        per = evaluation.score_heldout({"teacher": teacher, "sliced": sliced, "refitted": refitted}, held,
                                    reference="teacher", reference_cache=cache)
        found = {name: evaluation.summarise(per[name], held) for name in per}
        t, s, r = (found[name]["ce_per_byte"] for name in ("teacher", "sliced", "refitted"))
        record["sets"][held.name] = {
            "teacher_ce_per_byte": round(t, 4), "sliced_ce_per_byte": round(s, 4),
            "refitted_ce_per_byte": round(r, 4), "sliced_kl": round(found["sliced"]["kl"], 4),
            "refitted_kl": round(found["refitted"]["kl"], 4), "gap_closed": round((s - r) / (s - t), 4)}
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
