"""The recipe's configuration, declared once: one frozen dataclass per section, each field with its default, help,
why, what None means and its flag (`nnx_surgery.field_docs.documented`). `RecipeConfig` holds the sections and
`distill`, the real `DistillConfig` of the run (each phase is `dataclasses.replace` of it).

Read top to bottom, this file is the recipe's defaults file: a preset (presets/*.json) overrides some of them,
a --config file more, flags and --set the rest (nnx_surgery/recipes/config/layering.py).

Imports no jax: `nnx-surgery COMMAND --help` makes the subcommands' shared flags from these fields.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from nnx_surgery.field_docs import documented
from nnx_surgery.recipes.config.loss_term_weights import TermWeights

if TYPE_CHECKING:
    from nnx_surgery.distill.loop.run_config import DistillConfig

POSITIVE_RATE = ("a finite learning rate above 0, e.g. 3e-4", lambda v: 0 < v < math.inf)
COUNT0 = ("0 or more", lambda v: v >= 0)
PRESET_NAMES = ("7b", "gemma3-270m", "gemma3-270m-tpu", "tiny")  # presets/<name>.json
SCHEDULE_NAMES = ("none", "progressive", "sft-then-distil")  # presets/schedules.json
# --general-source: what --general-mix's prose is; PACKAGED_SOURCES read the prose extra's packages
GENERAL_SOURCES = ("pydoc", "packages", "pydoc+packages")
PACKAGED_SOURCES = ("packages", "pydoc+packages")
CONTROL_NAMES = {"scratch": "scratch student (same shape)", "pruned-ce": "CE-retrained pruned student (control)"}


@dataclasses.dataclass(frozen=True)
class RunSection:
    """How this run is invoked and where it writes (mostly not saved: a resumed run may change them)."""

    preset: str = documented("7b", "a measured set of defaults: 7b (the real job), gemma3-270m (the real 270M, "
                             "offline, CPU-sized), gemma3-270m-tpu (the same job at 100x the tokens in bf16, for "
                             "one accelerator chip; needs the prose extra), tiny (a self-trained toy teacher, for "
                             "tests)", flag="--preset",
                             choices=PRESET_NAMES)
    output: str | None = documented(None, "run folder: student, plans, results, checkpoints, resolved_config.json",
                                    flag="--output", also=("-o",), saved=False)
    resume: bool = documented(False, "continue an interrupted run in --output", flag="--resume",
                              action="store_true", saved=False)
    overwrite: bool = documented(False, "start over, deleting what is in --output", flag="--overwrite",
                                 action="store_true", saved=False)
    halt_after: str | None = documented(None, "stop after STEP of PHASE (teacher_correction, stage_a, stage_b, "
                                        "control) as if interrupted", flag="--halt-after", metavar="PHASE:STEP",
                                        saved=False)
    dry_run: bool = documented(False, "print shapes, parameters, memory and plan; no training", flag="--dry-run",
                               action="store_true", saved=False)
    print_config: bool = documented(False, "print the fully resolved configuration and exit",
                                    flag="--print-config", action="store_true", saved=False)
    cache_dir: str | None = documented(None, "where the tiny teacher and imported GGUFs are cached",
                                       flag="--cache-dir", none_means="$NNX_SURGERY_CACHE or ~/.cache/nnx-surgery",
                                       saved=False)
    seed: int = documented(0, "seeds the data split and order, the plan's calibration, new weights and sampling",
                           flag="--seed", kind=int, check=("a whole number from 0 to 4294967295",
                                                           lambda v: 0 <= v < 2 ** 32))
    gguf: str | None = documented(None, "also write the student as OUT/student-TYPE.gguf for llama.cpp (f32, f16, "
                                  "bf16, q8_0, q5_1, q5_0, q4_1, q4_0; Gemma families)", flag="--gguf",
                                  also=("--export-gguf",), metavar="TYPE", none_means="no GGUF file")
    push_to_hub: str | None = documented(None, "publish the student (private unless --public)",
                                         flag="--push-to-hub", metavar="REPO_ID", saved=False)
    public: bool = documented(False, "make the pushed repo public", flag="--public", action="store_true",
                              saved=False)
    compile_ahead: str = documented("auto", "compile a training phase's first step while the phase before it "
                                    "runs (the distillation's during the MLP refit, the control's during the "
                                    "distillation): auto (on an accelerator, where a compile takes a minute), on, "
                                    "off", flag="--compile-ahead", choices=("auto", "on", "off"), saved=False)


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    model: str | None = documented(None, "Hub repo id, local HF folder, .gguf file or gguf:gemma3-270m",
                                   flag="--teacher", none_means="the preset's")
    revision: str | None = documented(None, "teacher revision on the Hub", flag="--revision",
                                      none_means="the default branch")
    steps: int = documented(300, "tiny preset: teacher training steps", flag="--teacher-steps", kind=int,
                            why="enough for a teacher with confident predictions to distil",
                            check=("0 or more steps", COUNT0[1]))
    correction: int = documented(0, "first fine-tune the teacher with plain CE on the distillation corpus for STEPS "
                                 "steps (its own batches; the student's are unchanged), then plan, prune and distil "
                                 "from the corrected teacher (Minitron's teacher correction); 0: off",
                                 flag="--teacher-correction", kind=int, metavar="STEPS",
                                 check=("a number of steps >= 0", COUNT0[1]))
    correction_lr: float | None = documented(None, "learning rate of the teacher correction (cosine, 2 warm-up "
                                             "steps)", flag="--teacher-correction-lr", kind=float,
                                             none_means="a tenth of --learning-rate", check=POSITIVE_RATE)


@dataclasses.dataclass(frozen=True)
class StudentSection:
    shape: str | None = documented(None, "scaled | a named shape (gemma-2b, ...) | layers=..,hidden=..,mlp=..,"
                                   "heads=..,kv_heads=..,vocab=.. (sizes, or fractions of the teacher's) | "
                                   "params=FRACTION or COUNT (e.g. 0.5, 120M: a budget of the teacher's "
                                   "non-embedding parameters, or with ,counting=total of the whole checkpoint): "
                                   "search the shapes within it first (Shape search) and distil the winner",
                                   flag="--student", none_means="the preset's")
    control: str = documented("pruned-ce", "the baseline trained on the same tokens: pruned-ce (Minitron's CE "
                              "retraining, what distillation must beat), scratch, or none", flag="--control",
                              choices=("pruned-ce", "scratch", "none"),
                              shortcut=("--no-scratch", "none", "same as --control none"))
    scratch_learning_rate: float | None = documented(None, "the scratch control's learning rate",
                                                     flag="--scratch-learning-rate", kind=float,
                                                     why="a random init takes a higher one",
                                                     none_means="--learning-rate", check=POSITIVE_RATE)


@dataclasses.dataclass(frozen=True)
class SurgerySection:
    compression: str = documented("staged", "staged: depth+MLP first, distil, then hidden/heads/KV merge; oneshot: "
                                  "the final cut at once", flag="--compression", choices=("staged", "oneshot"),
                                  why="past ~50% removed, one-shot pruning recovers poorly")
    stage_a_fraction: float = documented(0.3, "share of --steps spent distilling after stage A",
                                         flag="--stage-a-fraction", kind=float,
                                         check=("a share of --steps in (0, 1)", lambda v: 0 < v < 1))
    kv_warmup: float = documented(0.1, "share of --steps training only merged K/V projections and norms after a KV "
                                  "merge, so the new projections adapt before they disturb the rest",
                                  flag="--kv-warmup", kind=float,
                                  check=("a share of --steps in [0, 1)", lambda v: 0 <= v < 1))
    calibration_samples: int = documented(128, "rows of data for activation importance (Minitron: 1024; 0: "
                                           "data-free scores from the weights)", flag="--calibration-samples",
                                           kind=int, check=("0 or more rows", COUNT0[1]))
    refit_rows: int = documented(64, "rows of data (in the student's tokens) on which each narrowed MLP's down "
                                 "projection is refitted by least squares to the teacher's whole MLP, layer by "
                                 "layer, before training (0: the teacher's slices as cut)", flag="--refit-rows",
                                 kind=int, check=("0 or more rows", COUNT0[1]),
                                 why="the kept neurons' slice of down_proj was fitted beside the dropped ones; "
                                 "refitted, the cut student starts far nearer the teacher at the cost of two passes "
                                 "of each layer over these rows")
    from_disk: bool = documented(False, "cut the student with prune_checkpoint (reads only the kept slices of the "
                                 "teacher files: less memory)", flag="--from-disk", action="store_true")


@dataclasses.dataclass(frozen=True)
class DataSection:
    files: str | None = documented(None, "training text: a file, folder or glob (.txt/.py/.jsonl), or hf:NAME for "
                                   "a dataset", flag="--data", none_means="the Python standard library's source, "
                                   "offline")
    corpus_bytes: int = documented(2_000_000, "bytes of standard library source when --data is not given",
                                   flag="--corpus-bytes", kind=int, check=("at least 1 byte", lambda v: v >= 1))
    restart_rows: bool = documented(True, "a packed row that continues a document starts with BOS (when the "
                                    "tokenizer adds one), as every document does", flag="--restart-rows",
                                    action="boolean", why="Gemma without BOS at position 0 predicts far worse, "
                                    "teacher included, so such rows would teach from its worst predictions")
    general_mix: float = documented(0.0, "share of the training text that is general English prose (the pydoc "
                                    "topics' train part, repeated; disjoint from the general held-out set), so the "
                                    "student also recovers outside the corpus's domain; 0: the corpus alone",
                                    flag="--general-mix", kind=float, metavar="FRACTION",
                                    check=("the share of general text, in [0, 1)", lambda v: 0 <= v < 1))
    general_source: str = documented("pydoc", "what --general-mix's prose is: pydoc (the pydoc topics' train "
                                     "part, with every Python; about 110 kB, repeated), packages (the prose "
                                     "extra's public-domain prose, about 7 MB: the World English Bible and the CIA "
                                     "World Factbook's prose, read where pip installed them; README 'Corpora and "
                                     "licences') or pydoc+packages (both, half of the general share each by bytes: "
                                     "the pydoc train part repeated to its half, the packaged prose making the "
                                     "other; needs the prose extra too); each trains only, never a held-out set",
                                     flag="--general-source", choices=GENERAL_SOURCES)
    batch_size: int = documented(8, "sequences per micro-batch (global, over the mesh)", flag="--batch-size",
                                 kind=int, check=("at least 1 row per batch", lambda v: v >= 1))
    seq_len: int = documented(256, "tokens per sequence", flag="--seq-len", kind=int,
                              check=("at least 2 tokens per row", lambda v: v >= 2))


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    """What the distillation stages are built from (the distill section holds the rest of DistillConfig)."""

    steps: int = documented(200, "total distillation optimizer steps over all stages", flag="--steps", kind=int,
                            check=("from 1 to 2,147,483,647 optimizer steps (int32 step counters)",
                                   lambda v: 1 <= v <= 2 ** 31 - 1))
    learning_rate: float = documented(1e-4, "peak learning rate of the stages (cosine decay to 0.1x)",
                                      flag="--learning-rate", kind=float, check=POSITIVE_RATE,
                                      why="measured on the real 270M: 3e-4 recovered 0.2-0.4 nats less")
    warmup_steps: int | None = documented(None, "learning-rate warm-up steps (a few keep Adam's first updates "
                                          "small)", flag="--warmup-steps", kind=int, none_means="2% of --steps",
                                          check=("from 0 to --steps warm-up steps (a longer warm-up never reaches "
                                                 "the peak learning rate)", lambda v: v >= 0))
    alpha: float = documented(1.0, "weight of the divergence; 1 - alpha goes to hard-label CE (1: pure "
                              "distillation, best when the teacher is strong)", flag="--alpha", kind=float,
                              check=("a weight in [0, 1] (1: forward KL alone, 0: cross-entropy alone)",
                                     lambda v: 0 <= v <= 1))
    temperature: Any = documented(1.0, "distillation temperature, a number or a ramp START:END over the run (e.g. "
                                  "3:1: soft targets first, then sharp)", flag="--temperature")
    loss: str = documented("kl", "the divergence to the teacher: forward KL (mass-covering, the standard), reverse "
                           "KL (mode-seeking), or JSD (bounded)", flag="--loss", choices=("kl", "reverse_kl", "jsd"))
    term_weights: TermWeights = documented(help="the loss terms' weights beside the divergence (their flags: "
                                           "--<term>-weight)", factory=TermWeights)
    trainable: tuple[str, ...] | None = documented(None, "train only these parameters in every phase but the K/V "
                                                   "warm-up (e.g. 'layers.{6-8}.*'); repeatable", flag="--trainable",
                                                   action="append", metavar="PATTERN", none_means="everything")
    frozen: tuple[str, ...] | None = documented(None, "keep these frozen in every phase, control included (e.g. "
                                                "embed_tokens: not pruned, and freezing it skips the head "
                                                "gradient); repeatable", flag="--frozen", action="append",
                                                metavar="PATTERN", none_means="nothing")
    schedule: str = documented("none", "main stages: none (one stage from these flags), progressive (first 80% of "
                               "layers frozen at 1e-4, then 50% at 5e-5, then all at 1e-5; T 3->1; alpha 0.5), "
                               "sft-then-distil (CE, ramping to alpha*KL + (1-alpha)*CE); tune with "
                               "training.schedule_options in --config", flag="--schedule", choices=SCHEDULE_NAMES)
    schedule_options: Mapping[str, Any] | None = documented(None, "the named schedule's options (any parameter of "
                                                            "its distill.loop.schedules function; \"epochs\" sizes it in "
                                                            "epochs)", none_means="the schedule's own")
    stages: tuple[Mapping[str, Any], ...] | None = documented(None, "the main stages written out (DistillConfig "
                                                              "Stage fields, or `fraction` of the main steps "
                                                              "instead of steps)", none_means="from the flags or "
                                                              "--schedule")
    teacher_cache: str = documented("none", "the teacher's top k read from a cache in the steps: auto writes one "
                                    "where rows are read more than once (the shape search's candidates, phases "
                                    "longer than an epoch; needs --top-k; the same loss), always (every "
                                    "distillation phase), or a folder from `nnx-surgery cache-teacher` for every "
                                    "distillation phase", flag="--teacher-cache", metavar="none|auto|always|FOLDER",
                                    why="a search's candidates all read the same rows: the teacher runs once")
    cache_selection: str = documented("top", "what a teacher cache the run writes holds per token: top (the "
                                      "teacher's top k, trained on as --top-k trains with the teacher running), "
                                      "sampled (k stratified draws of its distribution, each piece with its share "
                                      "of the draws: the full distribution in expectation) or mixed (its top k/2 "
                                      "exactly and k/2 draws of the rest); auto caches every distillation phase "
                                      "with draws", flag="--cache-selection", choices=("top", "sampled", "mixed"),
                                      why="a top-k cache teaches the student to give the rest of the vocabulary "
                                      "no mass; draws do not")
    precision: str = documented("fp32", "bf16: bf16 teacher and student compute with float32 master weights (half "
                                "the memory; on a CPU with bf16 matrix units about twice fp32's steps per second)",
                                flag="--precision",
                                choices=("bf16", "fp32"))
    mesh: str | None = documented(None, "mesh axis sizes, e.g. fsdp=8,tp=1", flag="--mesh",
                                  none_means="one device")
    mesh_devices: int | None = documented(None, "run the mesh on the first N devices only", flag="--mesh-devices",
                                          kind=int, none_means="every device",
                                          check=("at least 1 device", lambda v: v >= 1))

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.precision == "bf16" else "float32"

    def __post_init__(self) -> None:  # the settings tree holds term weights as a mapping
        object.__setattr__(self, "term_weights", TermWeights.of(self.term_weights))


@dataclasses.dataclass(frozen=True)
class SearchSection:
    """The shape search (--student params=...)."""

    candidates: int = documented(6, "shapes the search trains: always the uniform guess (every axis cut by the "
                                 "same ratio, the shape one would pick by hand: does the search beat it?), from "
                                 "N=3 on the shape nearest the same uniform cut of depth, hidden and MLP with every "
                                 "head kept, and the rest from the shapes within the budget (largest non-embedding "
                                 "count first): the middle one of each of that many equal slices of the list; all "
                                 "of them when fewer fit", flag="--search-candidates", kind=int, metavar="N",
                                 check=("at least 1 shape", lambda v: v >= 1))
    shapes: str | None = documented(None, "the shapes to try instead of --search-candidates' spread, separated by "
                                    "';' (e.g. the top of a shorter search, trained longer); each must be within "
                                    "the budget; the uniform guess is always tried first", flag="--search-shapes",
                                    metavar="'SHAPE;SHAPE'", none_means="--search-candidates' spread")
    steps: int | None = documented(None, "distillation steps per candidate (the recipe's loss weights, learning "
                                   "rate, batch and sequence, on identical batches), each scored on the held-out "
                                   "sets at a third, two thirds and the end", flag="--search-steps", kind=int,
                                   metavar="S", none_means="a tenth of --steps, at least 3",
                                   why="right after pruning the ranking does not predict the trained one "
                                   "(Minitron), so each candidate gets a short distillation: a tenth of --steps "
                                   "keeps N candidates at N/10 of the main distillation's cost",
                                   check=("at least 1 step per candidate", lambda v: v >= 1))
    tolerance: float = documented(0.05, "how far from the budget a candidate's parameter count may be (relative)",
                                  flag="--search-tolerance", kind=float, metavar="FRACTION",
                                  check=("a fraction in (0, 1), e.g. 0.05", lambda v: 0 < v < 1))


@dataclasses.dataclass(frozen=True)
class EvaluationSection:
    batches: int = documented(8, "held-out batches per evaluation during training", flag="--eval-batches",
                              kind=int, check=("at least 1", lambda v: v >= 1))
    tokens: int = documented(4096, "scored tokens of each final held-out set (in-domain: the corpus's held-out "
                             "documents; general: held-out pydoc topics; far-domain: prose from files no training "
                             "text comes from), reported per token "
                             "and per byte with 95% intervals; more tokens, narrower intervals, longer evaluation",
                             flag="--eval-tokens", kind=int, check=("at least 64 scored tokens (thousands to "
                                                                    "decide between students)", lambda v: v >= 64))
    general: bool = documented(True, "also judge every model on the general-domain sets, near (held-out pydoc "
                               "topics, the source of --general-mix's prose) and far (Python's history, IDLE's "
                               "change logs, the email package's notes: no training text comes from them): what "
                               "compression must keep beyond the training domain", flag="--general-eval",
                               action="boolean")
    prompts: int = documented(8, "held-out prompts continued greedily, for generations and BLEU/ROUGE",
                              flag="--eval-prompts", kind=int, check=("0 or more prompts", COUNT0[1]))
    new_tokens: int = documented(48, "tokens generated per prompt in the evaluation", flag="--new-tokens",
                                 kind=int, check=("at least 1", lambda v: v >= 1))
    choice_items: int = documented(32, "next-line multiple-choice items scored by log-likelihood",
                                   flag="--choice-items", kind=int, check=("0 or more items", COUNT0[1]))
    tasks: str | None = documented(None, "also score every model on lm-evaluation-harness tasks (the lm-eval "
                                   "extra), e.g. nnx_offline (three offline tasks from the standard library) or "
                                   "hellaswag,arc_easy; scores with standard errors in the results",
                                   flag="--eval-tasks", metavar="NAMES", none_means="none")
    tasks_limit: int | None = documented(None, "at most N documents per --eval-tasks task", flag="--eval-tasks-limit",
                                         kind=int, metavar="N", none_means="every document",
                                         check=("at least 1 document", lambda v: v >= 1))


@dataclasses.dataclass(frozen=True)
class AotSection:
    """Ahead-of-time compile: will it fit? No weights read, nothing trained."""

    target: str | None = documented(None, "compile the run's programs (each stage's train step, the evaluation, "
                                    "the control, the calibration forward) for TARGET, print memory per device, "
                                    "FLOPs and time estimates, write OUT/aot_report.json and stop: a TPU topology "
                                    "(v5e:2x4, v5e:4x4, v5p:2x2x1, v6e:2x4, v4:2x2x1, ...; needs libtpu, see "
                                    "README 'Will it fit?') or cpu:N (N host devices); --mesh defaults to fsdp over "
                                    "all of them", flag="--aot", metavar="TARGET", saved=False)
    tokens: float | None = documented(None, "a token budget (e.g. 94e9): the report adds the days the main stage's "
                                      "step would take for it", flag="--aot-tokens", kind=float, metavar="TOKENS",
                                      saved=False, check=("a token budget above 0, e.g. 94e9", lambda v: v > 0))
    mfu: float | None = documented(None, "the share of the peak bf16 FLOP/s the time estimate assumes",
                                   flag="--aot-mfu", kind=float, metavar="SHARE", none_means="0.4", saved=False,
                                   check=("the share of the peak FLOP/s a step reaches, in (0, 1], e.g. 0.4",
                                          lambda v: 0 < v <= 1))
    search: bool = documented(False, "also search the mesh splits, micro-batches, remat policies and logit loss "
                              "for the fastest estimate that fits with 10% free (done anyway when the asked "
                              "settings do not fit)", flag="--aot-search", action="store_true", saved=False)


@dataclasses.dataclass(frozen=True)
class MultiHostSection:
    """jax.distributed: every process runs the same command."""

    distributed: str | None = documented(None, "auto: let JAX detect the cluster (Cloud TPU pod slices, SLURM, "
                                         "Open MPI) through jax.distributed.initialize() without arguments",
                                         flag="--distributed", choices=("auto",), saved=False)
    coordinator: str | None = documented(None, "process 0's address and a free port, to launch by hand (with "
                                         "--num-processes and --process-id)", flag="--coordinator",
                                         metavar="HOST:PORT", saved=False)
    num_processes: int | None = documented(None, "how many processes the run has", flag="--num-processes",
                                           kind=int, metavar="N", saved=False)
    process_id: int | None = documented(None, "this process's id, 0 to N-1 (0 prints and writes the reports)",
                                        flag="--process-id", kind=int, metavar="I", saved=False)
    heartbeat_timeout: int | None = documented(None, "a process silent this long is declared dead and JAX stops "
                                               "the others with an error naming it", flag="--heartbeat-timeout",
                                               kind=int, metavar="SECONDS", none_means="100, JAX's", saved=False)


def _default_distill() -> "DistillConfig":
    from nnx_surgery.distill.loop.run_config import DistillConfig
    return DistillConfig()


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """Every setting of a compress run, after layering (nnx_surgery/recipes/config/layering.py), frozen. `distill`
    is the run's DistillConfig: the recipe's sizes, precision, mesh, seed and evaluation batches filled in, and
    the one stage the flags make; each phase replaces its stages, plan and folders."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    teacher: TeacherSection = dataclasses.field(default_factory=TeacherSection)
    student: StudentSection = dataclasses.field(default_factory=StudentSection)
    surgery: SurgerySection = dataclasses.field(default_factory=SurgerySection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    training: TrainingSection = dataclasses.field(default_factory=TrainingSection)
    search: SearchSection = dataclasses.field(default_factory=SearchSection)
    evaluation: EvaluationSection = dataclasses.field(default_factory=EvaluationSection)
    aot: AotSection = dataclasses.field(default_factory=AotSection)
    multi_host: MultiHostSection = dataclasses.field(default_factory=MultiHostSection)
    distill: "DistillConfig" = dataclasses.field(default_factory=_default_distill)

    @property
    def tokens_per_step(self) -> int:
        return self.data.batch_size * self.data.seq_len * self.distill.grad_accum

    @property
    def control_name(self) -> str | None:
        return CONTROL_NAMES.get(self.student.control)


# section name -> its dataclass, in the order --help and resolved_config.json show them
SECTIONS: dict[str, type] = {field.name: field.default_factory for field in dataclasses.fields(RecipeConfig)  # type: ignore[misc]
                             if field.name != "distill"}
SECTION_TITLES = {"run": "Run", "teacher": "Teacher", "student": "Student and baseline", "surgery": "Surgery",
                  "data": "Data", "training": "Training (the stages)", "search": "Shape search (--student params=...)",
                  "evaluation": "Evaluation", "aot": "Ahead-of-time compile (will it fit? no weights read, nothing "
                  "trained)", "multi_host": "Multi-host (jax.distributed; every process runs the same command)"}

__all__ = ["RecipeConfig", "RunSection", "TeacherSection", "StudentSection", "SurgerySection", "DataSection",
           "TrainingSection", "SearchSection", "EvaluationSection", "AotSection", "MultiHostSection", "SECTIONS",
           "SECTION_TITLES", "PRESET_NAMES", "SCHEDULE_NAMES", "CONTROL_NAMES", "GENERAL_SOURCES",
           "PACKAGED_SOURCES"]
