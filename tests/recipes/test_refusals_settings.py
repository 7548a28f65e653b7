"""Every number `compress` takes, now and as flags and settings are added (issue 43): each numeric flag of the
recipe (its declaration in nnx_surgery/recipes/config/) and each numeric setting of the distill section (DistillConfig, through
--set) given a non-finite or negative value is refused in one line with exit 2 before anything is written, or is
one of the few documented readings of 0 / a negative number listed here. The cases are read from the
declarations, so a new flag or setting without a range check fails here."""
from __future__ import annotations

import contextlib
import io

import pytest

import refusal_env  # noqa: F401  (puts the repository on sys.path)

# what a flag or setting may be (a documented reading), by value: 0 switches these off or means "none"
ZERO_MEANS_OFF = {"--teacher-steps", "--calibration-samples", "--teacher-correction", "--warmup-steps",
                  "--eval-prompts", "--choice-items", "--sft-patience", "--search-candidates", "--refit-rows"}
NOT_NUMBERS_OF_THE_RUN = {"--seed", "--process-id", "--num-processes", "--heartbeat-timeout", "--mesh-devices"}
ANY_SIGN = {"targets.kl_below", "targets.correlation_above", "targets.perplexity_below", "targets.utilisation_above",
            "targets.mfu_above", "peak_flops"}  # monitoring thresholds: a target that cannot be met is the user's


def numeric_flags() -> list[tuple[str, type]]:
    from nnx_surgery.recipes.config.layering import every_field

    return [(item.flag, item.meta["kind"]) for item in every_field()
            if item.flag and item.meta.get("kind") in (int, float) and item.flag not in NOT_NUMBERS_OF_THE_RUN]


def numeric_settings() -> list[str]:
    from nnx_surgery import distill
    from nnx_surgery.recipes.config.layering import MANAGED

    def leaves(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from leaves(prefix + (key,), inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield ".".join(prefix)

    data = distill.DistillConfig().to_dict()
    return [path for path in leaves((), data) if path.split(".")[0] not in (*MANAGED, "stages")
            and path not in ANY_SIGN] + [name for name in NONE_BY_DEFAULT if name not in MANAGED]


NONE_BY_DEFAULT = ("top_k", "eval_every", "logit_chunk", "logit_block", "logit_vocab_slice")  # numbers when given


def refuses(*argv: str) -> None:
    """The recipe's settings (`resolution.resolve`, which every compress run starts with and which writes
    nothing) refuse `argv` with a RecipeError (one line through `guarded`) or argparse's one-line exit 2."""
    from nnx_surgery.recipes.compress import resolution
    from nnx_surgery.refusals import USER_ERRORS

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            resolution.resolve(["--preset", "tiny", "--output", "unused", *argv])
        except SystemExit as stop:
            assert stop.code == 2 and len(err.getvalue().strip().splitlines()) == 1, (argv, err.getvalue())
            return
        except USER_ERRORS as error:
            assert "\n" not in str(error).strip(), (argv, str(error))
            return
    pytest.fail(f"compress {' '.join(argv)} was accepted")


def test_the_tables_are_read():
    flags, settings = numeric_flags(), numeric_settings()
    assert len(flags) > 25 and ("--kv-warmup", float) in flags and ("--eval-batches", int) in flags
    assert len(settings) >= 20 and "optimizer.b1" in settings and "guard.window" in settings


@pytest.mark.parametrize("flag,kind", numeric_flags(), ids=str)
def test_every_numeric_flag_refuses_what_it_cannot_take(flag, kind):
    values = ["nan", "inf", "-1"] if kind is float else ["-1"] + ([] if flag in ZERO_MEANS_OFF else ["0"])
    for value in values:
        refuses(flag, value)


@pytest.mark.parametrize("path", numeric_settings())
def test_every_numeric_setting_refuses_non_finite_values(path):
    for value in ("NaN", "Infinity", "-Infinity"):
        refuses("--set", f"{path}={value}")
