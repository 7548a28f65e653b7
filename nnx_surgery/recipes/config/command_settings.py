"""The subcommands' own settings, declared as the recipe's are (`documented`): each flag's name, meaning, default and
check once. A setting the recipe has too (--steps, --data, --seed, --output, --overwrite, --teacher, --student,
--revision, --cache-selection, ...) is not here: a subcommand offers it from the recipe's declaration
(sections.py) under the same name and with the same meaning (nnx_surgery/cli.py, `_shared`). One name, one
meaning: a subcommand's setting that differs from the recipe's has a name of its own (`RENAMED` in cli.py refuses
the old spellings in one line).

Imports nothing heavy: `nnx-surgery COMMAND --help` builds its parser from these without jax."""
from __future__ import annotations

import dataclasses
from typing import Literal

from nnx_surgery.field_docs import documented
from nnx_surgery.shared_settings import distill_top_k

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
WeightDtype = Literal["float32", "bfloat16", "float16"]
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
CACHE_ENCODINGS = ("q8z", "q8", "q16", "float16", "exact")


def _positive(value: int) -> bool:
    return value >= 1


POSITIVE = ("at least 1", _positive)


@dataclasses.dataclass(frozen=True)
class PruneSettings:
    dtype: WeightDtype | None = documented(None, "the student's dtype", flag="--dtype", choices=WEIGHT_DTYPES,
                                           none_means="the teacher checkpoint's")


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    teacher_cache_folder: str | None = documented(
        None, "train from this teacher cache (`nnx-surgery cache-teacher` with the same TEACHER and data flags) "
        "without loading the teacher; TEACHER still gives the tokenizer and is checked against the cache",
        flag="--teacher-cache-folder", metavar="CACHE", none_means="the teacher runs")
    top_k: int | None = distill_top_k()  # DistillConfig's (compress's --top-k): one declaration


@dataclasses.dataclass(frozen=True)
class EvalCommandSettings:
    compare: tuple[str, ...] = documented((), "also the differences A - B of two FOLDERs (named as in the table) "
                                          "with 95% intervals, e.g. distilled:control; repeatable (every FOLDER "
                                          "is compared with the teacher anyway)", flag="--compare", action="append",
                                          metavar="A:B")
    include_path: str | None = documented(None, "a folder of lm-eval task YAML files for --eval-tasks",
                                          flag="--include-path", metavar="FOLDER",
                                          none_means="the packaged offline tasks")
    tasks_batch: int = documented(16, "rows per scoring batch of --eval-tasks", flag="--tasks-batch", kind=int,
                                  metavar="ROWS", check=POSITIVE)


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
    prompt: str | None = documented(None, "the text to continue", flag="--prompt")
    max_new_tokens: int = documented(64, "at most this many tokens (the prompt and these must fit in the model's "
                                     "positions)", flag="--max-new-tokens", kind=int, check=POSITIVE)
    truncate_prompt: bool = documented(False, "keep only the prompt's last tokens when it is longer than the "
                                       "model's positions leave room for (said on stderr); default: refuse",
                                       flag="--truncate-prompt", action="store_true", saved=False)
    sample_temperature: float = documented(0.0, "0: greedy; else sample at this temperature",
                                           flag="--sample-temperature", kind=float,
                                           check=("at least 0", lambda v: v >= 0))
    sample_top_k: int | None = documented(None, "sample from the k most likely tokens", flag="--sample-top-k",
                                          kind=int, check=POSITIVE, none_means="every token")
    sample_top_p: float | None = documented(None, "nucleus sampling: the smallest set of tokens holding this share "
                                            "of the probability, in (0, 1]", flag="--sample-top-p", kind=float,
                                            check=("in (0, 1]", lambda v: 0 < v <= 1), none_means="every token")
    dtype: WeightDtype = documented("float32", "the weights' dtype in memory", flag="--dtype",
                                    choices=WEIGHT_DTYPES)


@dataclasses.dataclass(frozen=True)
class ImportGGUFSettings:
    dtype: WeightDtype = documented("bfloat16", "the folder's weights (float32 keeps quantised values exact)",
                                    flag="--dtype", choices=WEIGHT_DTYPES)


@dataclasses.dataclass(frozen=True)
class ExportGGUFSettings:
    gguf_type: str = documented("q8_0", f"the GGUF tensor type of the matrices: {', '.join(GGUF_TYPES)} (compress "
                                "--gguf's types; --dtype elsewhere is the weights' dtype in memory)",
                                flag="--gguf-type", metavar="TYPE")


@dataclasses.dataclass(frozen=True)
class PushSettings:
    public: bool = documented(False, "create the repo public", flag="--public", action="store_true", saved=False,
                              shortcut=("--private", False, "create the repo private (the default)"))
    branch: str | None = documented(None, "the branch to push to", flag="--branch", none_means="main")
    message: str | None = documented(None, "the commit message", flag="--message", none_means="the Hub's")
    token_env: str | None = documented(None, "the environment variable holding the token; tokens are never taken "
                                       "as flags, printed or written", flag="--token-env", metavar="VAR",
                                       none_means="HF_TOKEN, else `hf auth login`'s")


@dataclasses.dataclass(frozen=True)
class CacheTeacherSettings:
    top_k: int | None = documented(None, "the teacher's most likely tokens kept per position (at most its "
                                   "vocabulary)", flag="--top-k", kind=int, metavar="K", check=POSITIVE)
    student_folder: str | None = documented(
        None, "a student folder with a trimmed vocabulary (its plan.json's kept pieces): the cache is then in its "
        "tokens, the teacher's top K over its pieces, for `distill TEACHER STUDENT --teacher-cache-folder`",
        flag="--student-folder", metavar="STUDENT", none_means="the teacher's vocabulary")
    encoding: str = documented("q8z", "how the top k are stored: q8z (q8's values, ids as sorted gaps, compressed "
                               "row by row: the smallest), q8, q16, float16 or exact (BENCHMARKS.md has bytes and "
                               "errors)", flag="--encoding", choices=CACHE_ENCODINGS)
    rows_per_shard: int = documented(256, "packed rows per shard file", flag="--rows-per-shard", kind=int,
                                     check=POSITIVE)


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """recipes/distill_then_dpo.py's own settings (the rest are the compress recipe's: --teacher, --student,
    --output, --learning-rate, --seq-len, ...)."""

    distill_steps: int = documented(60, "distillation steps before DPO", flag="--distill-steps", kind=int,
                                    check=POSITIVE)
    dpo_steps: int = documented(20, "DPO steps", flag="--dpo-steps", kind=int, check=POSITIVE)
    pairs: int = documented(64, "training preference pairs (plus a quarter held out)", flag="--pairs", kind=int,
                            check=POSITIVE)
    beta: float = documented(0.1, "DPO's beta (strength of the pull to the reference)", flag="--beta", kind=float,
                             check=("above 0", lambda v: v > 0))
    dpo_learning_rate: float = documented(1e-4, "DPO's learning rate", flag="--dpo-learning-rate", kind=float,
                                          check=("above 0", lambda v: v > 0))
    prompt_chars: int = documented(48, "characters of context per pair", flag="--prompt-chars", kind=int,
                                   check=POSITIVE)
    response_chars: int = documented(24, "characters of each response", flag="--response-chars", kind=int,
                                     check=POSITIVE)


# subcommand -> its own settings (the flags it shares with the recipe come from sections.py)
COMMAND_SETTINGS: dict[str, type] = {"prune": PruneSettings, "distill": DistillSettings, "eval": EvalCommandSettings,
                                     "generate": GenerateSettings, "import-gguf": ImportGGUFSettings,
                                     "export-gguf": ExportGGUFSettings, "push": PushSettings,
                                     "cache-teacher": CacheTeacherSettings}

__all__ = ["COMMAND_SETTINGS", "PruneSettings", "DistillSettings", "EvalCommandSettings", "GenerateSettings",
           "ImportGGUFSettings", "ExportGGUFSettings", "PushSettings", "CacheTeacherSettings", "DPOSettings",
           "WeightDtype"]
