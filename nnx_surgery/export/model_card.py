"""Model card (README.md) for a published student: Hub metadata plus the lineage that produced it.

The YAML front matter is written by huggingface_hub's `ModelCardData`, so it has the layout the Hub's
`/api/validate-yaml` expects: `base_model` (only when the teacher is a Hub repo id, never a local path),
`library_name: transformers`, `pipeline_tag: text-generation`, tags and an optional license.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import jax

from nnx_surgery.surgery.modeling.model_config import ConfigError, ModelConfig

# huggingface_hub is imported inside the functions that use it, as everywhere in the package: it reads HF_ENDPOINT,
# HF_HOME, HF_HUB_OFFLINE... once, when first imported, so `import surgery` must not import it before the caller
# has set them.

BASE_TAGS = ("pruned", "distilled", "nnx-surgery")


def is_hub_repo_id(name: str) -> bool:
    """True for a valid `namespace/name` Hub id that is not also an existing local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.exists(name) or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def write_model_card(folder: str | os.PathLike, *, teacher_id: str, teacher_revision: str | None = None,
                     plan_summary: str | Mapping[str, Any], data_description: str, steps: int, tokens: int,
                     losses: Mapping[str, Any], evaluation: Mapping[str, Any], license: str | None = None,
                     model_name: str | None = None, tags: Sequence[str] = (), datasets: Sequence[str] = (),
                     language: str | Sequence[str] | None = None, repo_id: str | None = None,
                     gguf: str | None = None) -> str:
    """Write `folder/README.md`; returns its path.

    `plan_summary` is free text or a mapping (e.g. {"layers": "26 -> 18", "hidden": "2304 -> 1536"});
    `losses` maps a loss name to its final value, or to a sequence of values (shown first -> last);
    `evaluation` maps a metric name to a value or to {"teacher": x, "student": y}. `repo_id` (default: the
    folder name) is used in the usage snippet; `gguf`, the name of a GGUF export of the same weights, adds how to
    run it with llama.cpp. Multi-host (`jax.distributed`): only process 0 writes (shared
    storage); the others return the path.
    """
    from huggingface_hub import ModelCardData

    folder = os.fspath(folder)
    if jax.distributed.is_initialized() and jax.process_index() != 0:
        return os.path.join(folder, "README.md")
    model_name = model_name or (repo_id or os.path.abspath(folder)).rstrip("/").rsplit("/", 1)[-1]
    base_model = teacher_id if is_hub_repo_id(teacher_id) else None
    data = ModelCardData(base_model=base_model, library_name="transformers", pipeline_tag="text-generation",
                         license=license, tags=list(dict.fromkeys([*BASE_TAGS, *tags])),
                         datasets=list(datasets) or None,
                         language=language if language is None or isinstance(language, str) else list(language),
                         model_name=model_name)
    text = f"---\n{data.to_yaml()}\n---\n\n" + _body(folder, model_name, repo_id or model_name, teacher_id,
                                                      teacher_revision, plan_summary, data_description, steps,
                                                      tokens, losses, evaluation, gguf)
    path = os.path.join(folder, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _body(folder, model_name, repo_id, teacher_id, teacher_revision, plan_summary, data_description, steps,
          tokens, losses, evaluation, gguf=None) -> str:
    teacher_link = f"[{teacher_id}](https://huggingface.co/{teacher_id})" if is_hub_repo_id(teacher_id) \
        else f"`{teacher_id}`"
    revision = f" at revision `{teacher_revision}`" if teacher_revision else ""
    lines = [f"# {model_name}", "",
             f"A smaller model derived from {teacher_link}{revision}: structured pruning initialised from the "
             "teacher's own weights, then knowledge distillation from the teacher, with nnx-surgery (Flax NNX).", ""]
    lines += _architecture(folder)
    lines += ["## Lineage", "", f"- **Teacher:** {teacher_link}{revision}", "- **Surgery plan:**"]
    if isinstance(plan_summary, Mapping):
        lines += [f"  - {key}: {_fmt(value)}" for key, value in plan_summary.items()]
    else:
        lines += [f"  {line}" for line in str(plan_summary).strip().splitlines()]
    lines += [f"- **Distillation data:** {data_description}",
              f"- **Training:** {int(steps):,} steps, {int(tokens):,} tokens", ""]
    if losses:
        lines += ["### Losses", "", "| loss | value |", "|---|---|"]
        lines += [f"| {name} | {_fmt(value)} |" for name, value in losses.items()]
        lines.append("")
    if evaluation:
        lines += ["## Evaluation", ""]
        if all(isinstance(v, Mapping) for v in evaluation.values()):
            columns = list(dict.fromkeys(k for v in evaluation.values() for k in v))
            lines += ["| metric | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
            lines += [f"| {name} | " + " | ".join(_fmt(v.get(c, "")) for c in columns) + " |"
                      for name, v in evaluation.items()]
        else:
            lines += ["| metric | value |", "|---|---|"]
            lines += [f"| {name} | {_fmt(value)} |" for name, value in evaluation.items()]
        lines.append("")
    lines += ["## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```", ""]
    if gguf:
        lines += [f"The same weights as one GGUF file for llama.cpp and the runtimes built on it: `{gguf}` (written "
                  "beside this folder; `nnx-surgery export-gguf` makes one of any dtype).", "", "```bash",
                  f'llama-cli -m {gguf} -p "def fib(n):" -n 48', "```", "", "```python",
                  "from llama_cpp import Llama  # pip install llama-cpp-python", "",
                  f'print(Llama("{gguf}")("def fib(n):", max_tokens=48)["choices"][0]["text"])', "```", ""]
    lines += ["## Limitations", "",
              "The student inherits the teacher's license, training data caveats and limitations. It is smaller "
              "and was trained on far fewer tokens than the teacher; check the evaluation above on your own task.",
              ""]
    return "\n".join(lines)


def _architecture(folder: str) -> list[str]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        config = json.load(f)
    rows = [("model_type", config.get("model_type"))]
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size"):
        if key in config:
            rows.append((key, config[key]))
    try:
        rows.append(("parameters", f"{ModelConfig.from_hf_dict(config).num_parameters():,}"))
    except ConfigError:  # a config the toolkit does not parse still gets a card, without the count
        pass
    return ["## Architecture", "", "| field | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return f"{_fmt(value[0])} -> {_fmt(value[-1])} ({len(value)} points)" if len(value) > 1 else _fmt(value[0])
    return str(value)
