"""Datasets through HF `datasets`, all local (no network): JSON lines, parquet, a `save_to_disk` folder and a folder
of data files; query options (`hf:NAME?prompt=...&completion=...`); prompt/completion records whose prompt is
masked out of the loss, checked down to the train step's loss; the recipe's `--data hf:NAME`."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import LossWeights, Stage
from nnx_surgery.distill.inputs.batches import DataError, TokenBatches
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.distill.inputs.sources import hf_dataset_records, parse_hf_spec
from nnx_surgery.distill.inputs.byte_tokenizer import BOS_ID, BYTE_OFFSET, EOS_ID, byte_tokenizer, save_byte_tokenizer

datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")

PAIRS = [{"prompt": f"Q{i}: {i}+{i}=", "completion": f"{2 * i}!", "id": i} for i in range(10)]
TEXTS = [{"body": f"document number {i} " * (1 + i % 3)} for i in range(6)]
SEQ_LEN = 16
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_data")
    with open(root / "qa.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in PAIRS)
    datasets.Dataset.from_list(PAIRS).to_parquet(str(root / "qa.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TEXTS[:4]),
                          "validation": datasets.Dataset.from_list(TEXTS[4:])}).save_to_disk(str(root / "saved"))
    os.makedirs(root / "texts")
    for part in (0, 1):
        with open(root / "texts" / f"part{part}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in TEXTS[part * 3:part * 3 + 3])
    return root


def packed(spec: str, **kwargs) -> TokenBatches:
    settings = dict(seq_len=SEQ_LEN, batch_size=2, eval_fraction=0, shuffle=False, drop_remainder=False)
    return TokenBatches.from_hf_dataset(spec, byte_tokenizer(), **{**settings, **kwargs})


def all_rows(batches: TokenBatches) -> dict[str, np.ndarray]:
    batch_count = -(-batches.num_rows // batches.batch_size)
    parts = [batches.next_batch() for _ in range(batch_count)]
    return {key: np.concatenate([p[key] for p in parts])[:batches.num_rows] for key in parts[0]}


def test_prompt_completion_jsonl_trains_only_on_completions(sources):
    """Each record packs as [BOS] prompt completion [EOS]; the supervised targets (token t + 1 where loss_mask[t])
    are exactly the completion and EOS tokens that do not open a row."""
    rows = all_rows(packed(str(sources / "qa.jsonl")))  # prompt/completion columns found without options
    stream, supervised = [], []
    for pair in PAIRS:
        prompt, completion = [BOS_ID] + byte_ids(pair["prompt"]), byte_ids(pair["completion"]) + [EOS_ID]
        stream += prompt + completion
        supervised += [False] * len(prompt) + [True] * len(completion)
    count = len(stream)
    np.testing.assert_array_equal(rows["input_ids"].reshape(-1)[:count], stream)
    expected = [token for i, (token, trained) in enumerate(zip(stream, supervised)) if trained and i % SEQ_LEN]
    mask = rows["loss_mask"]
    assert set(np.unique(mask)) == {0.0, 1.0} and not mask[:, -1].any()
    np.testing.assert_array_equal(rows["input_ids"][:, 1:][mask[:, :-1] == 1], expected)
    assert len(expected) < 0.5 * count  # the prompts really are most of the tokens, and are not trained on


def test_parquet_saved_folder_data_folder_and_query_options(sources):
    from_jsonl = all_rows(packed(str(sources / "qa.jsonl")))
    from_parquet = all_rows(packed("hf:" + str(sources / "qa.parquet")))
    for key in from_jsonl:
        np.testing.assert_array_equal(from_parquet[key], from_jsonl[key])
    # prompt/completion named explicitly, from other columns: the id is the prompt, the prompt the completion
    swapped = hf_dataset_records(str(sources / "qa.jsonl") + "?prompt=id&completion=prompt&max_records=2")
    assert swapped == [("0", "Q0: 0+0="), ("1", "Q1: 1+1=")]
    assert hf_dataset_records(str(sources / "saved") + "?split=validation&text=body") == [r["body"] for r in TEXTS[4:]]
    assert hf_dataset_records(str(sources / "texts"), text_field="body", max_records=4) == [
        r["body"] for r in TEXTS[:4]]
    streamed = hf_dataset_records(str(sources / "qa.jsonl") + "?streaming=1&max_records=3")
    assert streamed == [(p["prompt"], p["completion"]) for p in PAIRS[:3]]
    batches = packed(str(sources / "qa.jsonl"), eval_documents=2)
    assert all(text.startswith("Q") and text.endswith("!") for text in batches.eval_texts())
    assert parse_hf_spec("hf:org/name?config=en&split=test&max_records=5&streaming=true") == (
        "org/name", {"config": "en", "split": "test", "max_records": 5, "streaming": True})


@pytest.mark.parametrize("spec,kwargs,message", [
    ("qa.jsonl?text=body", {}, r"has columns \['prompt', 'completion', 'id'\], not \['body'\]"),
    ("qa.jsonl?prompt=prompt", {}, "give both a prompt and a completion field"),
    ("qa.jsonl?colour=red", {}, "unknown option 'colour'"),
    ("qa.jsonl?max_records=many", {}, "max_records='many' must be int"),
    ("saved?split=test", {"text_field": "body"}, r"splits \['train', 'validation'\], not 'test'"),
    ("hf:", {}, "names no dataset"),
])
def test_bad_dataset_specs_say_what_to_change(sources, spec, kwargs, message):
    with pytest.raises(DataError, match=message):
        hf_dataset_records(spec if spec.startswith("hf:") else str(sources / spec), **kwargs)


def test_mixed_data_files_are_refused(sources, tmp_path):
    for name in ("a.jsonl", "b.csv"):
        (tmp_path / name).write_text('{"text": "x"}\n' if name.endswith("jsonl") else "text\nx\n")
    with pytest.raises(DataError, match=r"one kind of data file at a time; found \['.csv', '.jsonl'\]"):
        hf_dataset_records(str(tmp_path))


def test_missing_datasets_package_names_the_extra(sources, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the package were not installed
    with pytest.raises(DataError, match=r"pip install 'nnx-surgery\[datasets\]'"):
        hf_dataset_records(str(sources / "qa.jsonl"))


def test_train_step_loss_counts_completion_targets_only(sources):
    """The train step's loss function (hard-label CE, no teacher) on a prompt/completion batch equals the mean
    negative log-likelihood over the completion targets alone, computed from the model's logits by hand."""
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from nnx_surgery.surgery.modeling.causal_lm import create_model

    model = create_model(ModelConfig.from_hf_dict(dict(
        model_type="gemma", vocab_size=260, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8)), seed=3)
    batch = {k: jnp.asarray(v) for k, v in packed(str(sources / "qa.jsonl")).next_batch().items()}
    graph, state = nnx.split(model)
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=False, ce=True, teacher=False, chunk=8))
    loss_fn = step_lib.make_loss_fn(graph, None, settings)
    hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=0.0, ce=1.0)), 0, 0.0)
    counts = step_lib.token_counts(jax.tree.map(lambda x: x[None], batch))
    run = jax.jit(loss_fn, compiler_options=FAST_COMPILE)
    loss, _ = run({"student": state, "proj": {}}, nnx.State({}), None, batch, counts, hyper)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def forward(state, batch):
        return nnx.merge(graph, state)(batch["input_ids"], positions=batch["positions"],
                                       segment_ids=batch["segment_ids"]).logits

    logits = np.asarray(forward(state, batch), np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    ids, mask = np.asarray(batch["input_ids"]), np.asarray(batch["loss_mask"])
    nll = -np.take_along_axis(log_probs[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    completion_only = float((nll * mask[:, :-1]).sum() / mask[:, :-1].sum())
    every_target = float(nll.mean())
    assert float(counts["tokens"]) == mask.sum()
    assert float(loss) == pytest.approx(completion_only, rel=1e-5)
    assert abs(completion_only - every_target) > 1e-3  # the mask changes the value: the check can fail


def test_recipe_data_flag_reads_a_local_dataset(sources, tmp_path):
    """`--data hf:SPEC`: the recipe's loader with a teacher folder holding the byte tokenizer."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.path.insert(0, root)
    from nnx_surgery.recipes.inputs import corpus
    from nnx_surgery import model_inputs
    from nnx_surgery import refusals

    teacher = save_byte_tokenizer(tmp_path / "teacher")
    with open(os.path.join(teacher, "config.json"), "w") as handle:
        json.dump({"model_type": "gemma", "max_position_embeddings": 64}, handle)
    settings = corpus.DataSettings(files=f"hf:{sources / 'qa.jsonl'}?max_records=8", corpus=None, description="",
                                   teacher_folder=teacher, batch_size=2, seq_len=SEQ_LEN, seed=0,
                                   position_limit=model_inputs.position_limit(teacher))
    data = corpus.load_data(settings)
    assert len(data.train_indices) + len(data.eval_indices) == 8
    assert all(text.startswith("Q") for text in data.eval_texts())
    batch = data.next_batch()
    assert batch["input_ids"].shape == (2, SEQ_LEN) and 0 < batch["loss_mask"].sum() < batch["loss_mask"].size / 2
    with pytest.raises(refusals.RecipeError, match="--general-mix needs text files"):
        corpus.load_data(dataclasses.replace(settings, general_mix=0.25))
