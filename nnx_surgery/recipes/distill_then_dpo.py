"""Distil a pruned student, then align it with DPO in Tunix, offline, and save it as a Hugging Face folder.

    python recipes/distill_then_dpo.py --output runs/dpo                     # the tiny self-trained teacher
    python recipes/distill_then_dpo.py --teacher path/to/gemma-3-270m --student layers=0.5,mlp=0.5 \\
        --distill-steps 200 --dpo-steps 50 --pairs 256 --output runs/dpo-270m

1. the teacher (a folder, Hub id or .gguf; by default the tiny stdlib-trained Gemma of nnx_surgery/recipes/inputs/tiny_teacher.py) is
   pruned to `--student` by the surgery planner and distilled for `--distill-steps` on the Python standard
   library's source;
2. preference pairs are built offline from that source: a prompt is a stretch of a file, the chosen response is
   the text that really follows it, the rejected one the same characters shuffled. Pairs from held-out files
   measure the result;
3. Tunix's DPOTrainer trains the student (`surgery.modeling.tunix.to_tunix`; the reference is a frozen copy of the
   distilled student) for `--dpo-steps`, and `from_tunix` hands it back;
4. the student is saved with its plan (`--output`/student, an HF folder transformers loads) and one line sums up
   the run: held-out preference accuracy (the student's log-likelihood of the real continuation above the
   shuffled one) and mean margin, before and after DPO.

Needs the `tunix` extra (`pip install 'nnx-surgery[tunix]' && pip install --no-deps google-tunix==0.1.7`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery import model_inputs
from nnx_surgery.recipes.inputs import tiny_teacher
from nnx_surgery import refusals
from nnx_surgery.distill.inputs.batches import stdlib_corpus
from nnx_surgery.distill.loop.trainer import DivergenceError
from tokenizers import Tokenizer
from nnx_surgery.surgery.modeling.tunix import from_tunix, require_tunix, to_tunix
from nnx_surgery.recipes.config import fields
from nnx_surgery.recipes.config.command_line import OneLineParser
from nnx_surgery.recipes.config.command_settings import DPOSettings
from nnx_surgery.recipes.config.layering import preset
from nnx_surgery.recipes.config.sections import SECTIONS


# the compress recipe's settings this recipe reads too: the same flags, meanings, defaults and checks
SHARED = ("teacher.model", "student.shape", "run.output", "run.overwrite", "training.learning_rate",
          "data.batch_size", "data.seq_len", "data.corpus_bytes", "teacher.steps", "run.cache_dir", "run.seed")


def declared_settings() -> list[fields.Declared]:
    """Every setting of the recipe: the compress recipe's it shares (SHARED), then its own (DPOSettings)."""
    recipe = {item.dest: item for name, kind in SECTIONS.items() for item in fields.declared(kind, (name,))}
    return [recipe[path] for path in SHARED] + fields.declared(DPOSettings, ("dpo",))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="distill_then_dpo.py", description=__doc__.split("\n\n")[0])
    for item in declared_settings():
        fields.add_option(parser, item, required=item.dest == "run.output",
                          help=SHARED_HELP.get(item.dest))
    args = parser.parse_args(argv)
    errors = fields.refusals_of(args, declared_settings())
    if errors:
        raise refusals.RecipeError(errors[0])
    args.student = args.student or preset("tiny")["student"]["shape"]  # None: the tiny preset's, as in compress
    args.cache_dir = args.cache_dir or os.environ.get("NNX_SURGERY_CACHE", os.path.expanduser("~/.cache/nnx-surgery"))
    return args


SHARED_HELP = {"teacher.model": "HF folder, Hub id or .gguf; the preset's here: the tiny stdlib-trained teacher",
               "student.shape": "student shape, as in gemma_7b_to_2b.py; the preset's here: the tiny preset's",
               "run.output": "run folder; the student goes to OUTPUT/student",
               "run.overwrite": "delete a non-empty --output first",
               "training.learning_rate": "distillation learning rate"}


def preference_pairs(files: list[str], count: int, args, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) from `files`: a stretch of text, what really follows it, and that shuffled."""
    texts = [t for t in (open(f, encoding="utf-8", errors="replace").read() for f in files)
             if len(t) > args.prompt_chars + args.response_chars]
    if not texts:
        raise distill.DataError("no source file is long enough for one preference pair; lower --prompt-chars / "
                                "--response-chars.")
    pairs = []
    while len(pairs) < count:
        text = texts[rng.integers(len(texts))]
        start = int(rng.integers(len(text) - args.prompt_chars - args.response_chars))
        middle = start + args.prompt_chars
        chosen = text[middle:middle + args.response_chars]
        rejected = "".join(rng.permutation(list(chosen)))
        if rejected != chosen:
            pairs.append((text[start:middle], chosen, rejected))
    return pairs


def tokenized(pairs, tokenizer, args) -> dict[str, np.ndarray]:
    """Prompt ids left padded (BOS as the tokenizer adds it), responses right padded, with their masks."""
    pad = tokenizer.token_to_id("<pad>") or 0

    def padded(rows, width, left):
        ids, mask = np.full((len(rows), width), pad, np.int32), np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            row = row[-width:] if left else row[:width]
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, span], mask[i, span] = row, 1
        return ids, mask

    prompts = [tokenizer.encode(p).ids for p, _, _ in pairs]
    chosen = [tokenizer.encode(c, add_special_tokens=False).ids for _, c, _ in pairs]
    rejected = [tokenizer.encode(r, add_special_tokens=False).ids for _, _, r in pairs]
    width = max(len(r) for r in chosen + rejected)
    out = {}
    out["prompt_ids"], out["prompt_mask"] = padded(prompts, max(len(p) for p in prompts), left=True)
    out["chosen_ids"], out["chosen_mask"] = padded(chosen, width, left=False)
    out["rejected_ids"], out["rejected_mask"] = padded(rejected, width, left=False)
    return out


def preference(model, batch: dict[str, np.ndarray]) -> tuple[float, float]:
    """Held-out (accuracy, mean margin): how often, and by how many nats, `model` finds the real continuation more
    likely than the shuffled one."""
    def logp(ids, mask):
        tokens = np.concatenate([batch["prompt_ids"], ids], axis=1)
        full = np.concatenate([batch["prompt_mask"], mask], axis=1)
        logits = model(jnp.asarray(tokens), attention_mask=jnp.asarray(full)).logits[:, -ids.shape[1] - 1:-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), jnp.asarray(ids)[..., None], -1)[..., 0]
        return np.asarray((picked * mask).sum(axis=1))

    margin = logp(batch["chosen_ids"], batch["chosen_mask"]) - logp(batch["rejected_ids"], batch["rejected_mask"])
    return float((margin > 0).mean()), float(margin.mean())


def distilled_student(args, folder: str, files: list[str]):
    teacher = surgery.load_pretrained(folder, dtype="float32")
    data = distill.TokenBatches.from_files(files, folder, batch_size=args.batch_size, seq_len=args.seq_len,
                                           seed=args.seed, eval_batch_size=args.batch_size)
    plan = surgery.plan_student(teacher, model_inputs.student_spec(args.student, teacher.config, vocabulary=False),
                                calibration=data.calibration_ids(min(64, 8 * args.batch_size)))
    student = surgery.apply_plan(teacher, plan)
    stage = distill.Stage(steps=args.distill_steps, learning_rate=args.learning_rate,
                          weights=distill.LossWeights(kl=0.5, ce=0.5), name="distill")
    result = distill.run(teacher, student, data, distill.DistillConfig(
        stages=(stage,), batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, plots=False,
        run_dir=os.path.join(args.output, "distill")))
    return result.student, plan


def dpo_train(student, pairs: dict[str, np.ndarray], args):
    """`--dpo-steps` of Tunix's DPO on `pairs` (cycled in batches); returns the trained student and its losses."""
    require_tunix()
    import optax
    from tunix.sft.dpo import dpo_trainer as dpo

    count = len(pairs["prompt_ids"])
    starts = [(step * args.batch_size) % count for step in range(args.dpo_steps)]
    batches = [dpo.TrainingInput(**{k: np.take(v, range(s, s + min(args.batch_size, count)), axis=0, mode="wrap")
                                    for k, v in pairs.items()}) for s in starts]
    trainer = dpo.DPOTrainer(to_tunix(student), to_tunix(nnx.clone(student)), optax.adamw(args.dpo_learning_rate),
                             dpo.DPOTrainingConfig(eval_every_n_steps=args.dpo_steps + 1, max_steps=args.dpo_steps,
                                                   beta=args.beta, pbar_description=None))
    trainer.train(batches)
    losses = [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]
    return from_tunix(trainer.model), losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        require_tunix()
    except ImportError as error:
        raise refusals.RecipeError(str(error)) from None
    args.output, _ = model_inputs.output_folder(args.output, resume=False, overwrite=args.overwrite, dry_run=False)
    if args.overwrite and os.path.isdir(args.output):
        shutil.rmtree(args.output)
    os.makedirs(args.output, exist_ok=True)
    if args.teacher:
        folder, files = model_inputs.teacher_folder(args.teacher, None), stdlib_corpus(args.corpus_bytes, seed=args.seed)
    else:
        folder, files = tiny_teacher.prepare(tiny_teacher.TinyTeacherSettings(
            args.corpus_bytes, args.seed, args.batch_size, args.seq_len, args.teacher_steps, args.cache_dir))
    held = max(1, len(files) // 5)
    train_files, heldout_files = files[held:] or files, files[:held]
    student, plan = distilled_student(args, folder, train_files)

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise refusals.RecipeError(f"--teacher {folder}: no tokenizer.json there; the preference pairs need the "
                                 "teacher's tokenizer.")
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    rng = np.random.default_rng(args.seed)
    train_pairs = tokenized(preference_pairs(train_files, args.pairs, args, rng), tokenizer, args)
    heldout = tokenized(preference_pairs(heldout_files, max(4, args.pairs // 4), args, rng), tokenizer, args)
    before = preference(student, heldout)
    student, losses = dpo_train(student, train_pairs, args)
    after = preference(student, heldout)
    if not all(np.isfinite(losses)):
        raise DivergenceError(f"DPO's loss went non-finite ({losses}); lower --dpo-learning-rate.")
    out = surgery.save_student(student, plan, os.path.join(args.output, "student"), source=folder)
    summary = dict(distill_steps=args.distill_steps, dpo_steps=args.dpo_steps, pairs=args.pairs,
                   dpo_loss=[losses[0], losses[-1]], heldout_accuracy=[before[0], after[0]],
                   heldout_margin=[before[1], after[1]], student=out)
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"distilled {args.distill_steps} steps, DPO {args.dpo_steps} steps on {args.pairs} pairs: loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f}; held-out preference accuracy {before[0]:.0%} -> {after[0]:.0%}, "
          f"margin {before[1]:+.2f} -> {after[1]:+.2f} nats; student saved to {out}")


if __name__ == "__main__":
    refusals.guarded(main)
