"""The recipe's configuration across formats and declarations: run folders written before the sectioned format
(resolved_config.json of the first format, every setting at the top level under its flag's name) load through
--config to the same settings and still resume; every setting is declared once, and its flag, its check and its
place in the saved config come from that declaration."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from nnx_surgery.recipes.config import command_line, layering
from nnx_surgery.recipes.compress import files, resolution
from nnx_surgery.recipes.config.sections import GENERAL_SOURCES, SECTIONS, RecipeConfig
from nnx_surgery.refusals import RecipeError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# what the first format's files were made with (`--print-config` before the sectioned format)
FIRST_FORMAT = {"resolved_config_first_format_tiny.json": ["--preset", "tiny"],
                "resolved_config_first_format_custom.json": [
                    "--preset", "tiny", "--schedule", "progressive", "--feature-kind", "pooled", "--set",
                    "loss_options.mse.on=features", "--top-k", "8", "--fallback", "switch_to_mse"]}


@pytest.mark.parametrize("name", sorted(FIRST_FORMAT))
def test_a_first_format_resolved_config_loads_to_the_same_settings(name):
    old = resolution.resolve(["--config", os.path.join(DATA, name)])
    now = resolution.resolve(FIRST_FORMAT[name])
    assert files.saved_config(old) == files.saved_config(now)
    assert old == now  # the sections and the run's DistillConfig


def test_a_run_folder_of_the_first_format_resumes_and_refuses_other_settings(tmp_path):
    shutil.copy(os.path.join(DATA, "resolved_config_first_format_custom.json"), tmp_path / "resolved_config.json")
    flags = FIRST_FORMAT["resolved_config_first_format_custom.json"]
    files.check_resumable(resolution.resolve([*flags, "--resume"]), str(tmp_path))  # the same settings: fine
    with pytest.raises(RecipeError, match=r"\['distill.top_k'\] differ"):
        files.check_resumable(resolution.resolve([*flags, "--top-k", "4", "--resume"]), str(tmp_path))


def test_a_run_saved_before_a_setting_existed_resumes_with_its_default(tmp_path):
    """A run folder saved before data.general_source was declared (the CPU demo's of an earlier `make demo`) ran
    with its default: `--resume` is not refused for it, and still is for a setting that truly differs."""
    flags = ["--preset", "gemma3-270m", "--output", str(tmp_path), "--resume"]
    saved = files.saved_config(resolution.resolve(flags))
    del saved["data"]["general_source"]
    (tmp_path / "resolved_config.json").write_text(json.dumps(saved))
    files.check_resumable(resolution.resolve(flags), str(tmp_path))
    saved["data"]["general_source"] = "packages"  # saved with the other value: refused
    (tmp_path / "resolved_config.json").write_text(json.dumps(saved))
    with pytest.raises(RecipeError, match=r"\['data.general_source'\] differ"):
        files.check_resumable(resolution.resolve(flags), str(tmp_path))


@pytest.mark.parametrize("source", GENERAL_SOURCES)
def test_every_general_source_is_accepted_saved_and_resumed(tmp_path, source):
    """--general-source's choices (pydoc+packages too) from a flag, --set or a config file; resolved_config.json
    reads back to the same choice and resumes with it; another saved choice is refused on --resume."""
    assert GENERAL_SOURCES == ("pydoc", "packages", "pydoc+packages")
    (tmp_path / "run.json").write_text(json.dumps({"data": {"general_mix": 0.5, "general_source": source}}))
    flags = ["--preset", "tiny", "--print-config", "--output", str(tmp_path / "out"), "--resume"]
    ways = (["--general-mix", "0.5", "--general-source", source],
            ["--set", "data.general_mix=0.5", "--set", f"data.general_source={source}"],
            ["--config", str(tmp_path / "run.json")])
    configs = [resolution.resolve([*flags, *way]) for way in ways]
    assert all(config.data.general_source == source for config in configs) and configs[0] == configs[1] == configs[2]
    saved = files.saved_config(configs[0])
    assert saved["data"]["general_source"] == source
    (tmp_path / "resolved_config.json").write_text(json.dumps(saved))
    again = resolution.resolve([*flags, "--config", str(tmp_path / "resolved_config.json")])
    assert again.data.general_source == source and files.saved_config(again) == saved
    files.check_resumable(configs[0], str(tmp_path))  # the same settings: resumes
    other = next(name for name in GENERAL_SOURCES if name != source)
    with pytest.raises(RecipeError, match=r"\['data.general_source'\] differ"):
        files.check_resumable(resolution.resolve([*flags, "--general-mix", "0.5", "--general-source", other]),
                              str(tmp_path))
    with pytest.raises(RecipeError, match="choose from pydoc, packages, pydoc\\+packages"):
        resolution.resolve(["--preset", "tiny", "--set", "data.general_source=pydoc+wiki"])


def test_the_first_format_names_an_unknown_setting(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"preset": "tiny", "stpes": 4}))
    with pytest.raises(RecipeError, match="unknown setting 'stpes'"):
        resolution.resolve(["--config", str(tmp_path / "old.json")])


def test_the_sectioned_config_file_and_the_flags_are_one_declaration(tmp_path):
    """A sectioned file, the flags and --set reach the same fields; the saved config is sectioned as the
    dataclasses are, holding only settings that decide what a run computes (not --output, --resume, ...)."""
    (tmp_path / "run.json").write_text(json.dumps({"training": {"steps": 12, "alpha": 0.5},
                                                   "evaluation": {"tokens": 128}, "distill": {"grad_accum": 2}}))
    config = resolution.resolve(["--preset", "tiny", "--config", str(tmp_path / "run.json"), "--set",
                                 "evaluation.tokens=256", "--output", str(tmp_path / "out")])
    assert (config.training.steps, config.training.alpha, config.evaluation.tokens) == (12, 0.5, 256)
    assert config.distill.grad_accum == 2 and config.distill.batch_size == config.data.batch_size
    saved = files.saved_config(config)
    assert [key for key in saved if key != "format"] == [*(n for n in SECTIONS if n not in ("aot", "multi_host")),
                                                         "distill"]
    assert "output" not in saved["run"] and "resume" not in saved["run"]
    assert "batch_size" not in saved["distill"] and "stages" not in saved["distill"]  # the recipe's own


def test_every_flag_comes_from_one_declared_field_and_no_flag_is_declared_twice():
    parser = command_line.build_recipe_parser()
    names = [name for action in parser._actions for name in action.option_strings]
    assert len(names) == len(set(names))
    declared = {item.dest for item in layering.every_field()}
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "config", "set"):
            assert action.dest in declared, action.option_strings
    # every section field is typed: nothing of the recipe's settings is an untyped record
    for kind in (RecipeConfig, *SECTIONS.values()):
        assert all(field.type for field in dataclasses.fields(kind))


def test_a_declared_check_refuses_a_value_from_any_layer(tmp_path):
    for flags in (["--eval-tokens", "8"], ["--set", "evaluation.tokens=8"]):
        with pytest.raises(RecipeError, match="--eval-tokens 8: give at least 64 scored tokens"):
            resolution.resolve(["--preset", "tiny", *flags])
    (tmp_path / "run.json").write_text(json.dumps({"evaluation": {"tokens": 8}}))
    with pytest.raises(RecipeError, match="--eval-tokens 8"):
        resolution.resolve(["--preset", "tiny", "--config", str(tmp_path / "run.json")])
