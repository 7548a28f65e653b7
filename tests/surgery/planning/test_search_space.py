"""The shapes a search compares: inside the budget, on each family's grid, counted as transformers counts them."""
import itertools

import pytest
import torch
import transformers

from nnx_surgery.surgery import ModelConfig
from nnx_surgery.surgery.plans.search_space import (ShapeCandidate, candidate_specs, parameter_counts, parse_budget,
                                                    uniform_spec)
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec

from hf_reference import LLAMA_FAMILIES, tiny_config


def teacher_config(family: str, **overrides) -> ModelConfig:
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=256)
    return ModelConfig.from_hf_dict(tiny_config(family, **{**sizes, **overrides}).to_dict())


def transformers_counts(teacher: ModelConfig, spec: StudentSpec) -> tuple[int, int]:
    """The student's (total, non-embedding) parameters as transformers builds the model from its config."""
    student = spec.config_for(teacher, list(range(spec.num_layers)))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**student.to_hf_dict()))
    total = model.num_parameters()
    embedding = model.get_input_embeddings().weight.numel()
    head = 0 if student.tie_word_embeddings else model.get_output_embeddings().weight.numel()
    return total, total - embedding - head


@pytest.mark.parametrize("family", ("gemma", "gemma2", "gemma3_text") + LLAMA_FAMILIES)
def test_counts_match_transformers(family):
    teacher = teacher_config(family)
    found = candidate_specs(teacher, params=0.5, tolerance=0.1)
    for candidate in found[:: max(1, len(found) // 6)]:
        assert (candidate.parameters, candidate.non_embedding) == transformers_counts(teacher, candidate.spec)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "llama", "qwen2"])
@pytest.mark.parametrize("counting", ["non_embedding", "total"])
def test_every_candidate_is_inside_the_budget_and_valid(family, counting):
    teacher = teacher_config(family)
    teacher_counts = parameter_counts(teacher, StudentSpec(8, 64, 128, 8, 4))
    target = round(teacher_counts[0 if counting == "total" else 1] * 0.6)
    found = candidate_specs(teacher, params=0.6, counting=counting, tolerance=0.05,
                            axes=("depth", "hidden", "mlp", "heads", "kv_heads"))
    assert len(found) > 3
    assert len({c.text for c in found}) == len(found)  # deduplicated
    for candidate in found:
        count = candidate.parameters if counting == "total" else candidate.non_embedding
        assert abs(count - target) <= 0.05 * target
        spec = candidate.spec
        spec.check_against(teacher)  # every candidate can be planned
        assert StudentSpec.from_text(candidate.text, teacher) == spec  # the text form is the spec
        assert spec.num_layers >= 4  # at most 50% of the depth by default
        if teacher.model_type in teacher.family.hidden_multiple_of_heads:
            assert spec.hidden_size % spec.num_attention_heads == 0
        assert spec.num_attention_heads % spec.num_key_value_heads == 0
    counts = [(c.non_embedding, c.parameters) for c in found]
    assert counts == sorted(counts, reverse=True)  # largest first


def test_the_grid_is_exhaustive_within_its_limits():
    """Against a brute force over every size: the search finds each shape on its grid that fits and is valid."""
    teacher = teacher_config("gemma3_text")
    found = {c.text for c in candidate_specs(teacher, params=0.5, tolerance=0.08, axes=("depth", "mlp"),
                                             max_cut={"mlp": 0.75}, grid=8)}
    target = parameter_counts(teacher, StudentSpec(8, 64, 128, 8, 4))[1] * 0.5
    expected = set()
    for layers, mlp in itertools.product(range(4, 9), range(16, 129, 16)):
        if mlp < 32:
            continue  # max_cut 0.75 of 128
        spec = StudentSpec(layers, 64, mlp, 8, 4)
        if abs(parameter_counts(teacher, spec)[1] - target) <= 0.08 * target:
            expected.add(ShapeCandidate(spec, *parameter_counts(teacher, spec)).text)
    assert found == expected and found


def test_limits_and_axes_are_respected():
    teacher = teacher_config("gemma2")
    for candidate in candidate_specs(teacher, params=0.5, axes=("depth", "mlp"), max_cut={"depth": 0.25},
                                     tolerance=0.15):
        spec = candidate.spec
        assert spec.num_layers >= 6
        assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads) == (64, 8, 4)


def test_uniform_guess_scales_every_axis_alike():
    teacher = teacher_config("gemma3_text", num_hidden_layers=16, hidden_size=256, intermediate_size=1024,
                             num_attention_heads=8)
    guess = uniform_spec(teacher, params=0.5)
    target = parameter_counts(teacher, StudentSpec(16, 256, 1024, 8, 4))[1] * 0.5
    assert abs(guess.non_embedding - target) <= 0.1 * target
    ratios = [guess.spec.num_layers / 16, guess.spec.hidden_size / 256, guess.spec.intermediate_size / 1024]
    assert max(ratios) - min(ratios) < 0.15


@pytest.mark.parametrize("params, message", [
    (1.0, "not below the teacher"),
    ("10B", "not below the teacher"),
    ("half", "give a fraction"),
    (0.01, "no student shape"),
])
def test_bad_budgets_are_refused(params, message):
    with pytest.raises(SpecError, match=message):
        candidate_specs(teacher_config("gemma2"), params=params)


def test_bad_options_are_refused():
    teacher = teacher_config("gemma2")
    with pytest.raises(SpecError, match="unknown search axes"):
        candidate_specs(teacher, params=0.5, axes=("depth", "width"))
    with pytest.raises(SpecError, match="max_cut"):
        candidate_specs(teacher, params=0.5, max_cut={"depth": 1.0})
    with pytest.raises(SpecError, match="counting"):
        candidate_specs(teacher, params=0.5, counting="embedding")


def test_budget_text():
    assert parse_budget("0.5") == 0.5 and parse_budget("120M") == 120_000_000 and parse_budget("1.5B") == 1.5e9
    assert parse_budget("800k") == 800_000 and parse_budget(3000) == 3000


def test_the_vocabulary_axis_counts_the_trimmed_embedding():
    teacher = teacher_config("gemma3_text", vocab_size=4096)
    found = candidate_specs(teacher, params=0.4, counting="total", axes=("depth", "mlp", "vocab"), tolerance=0.1)
    trimmed = [c for c in found if c.spec.vocab_size is not None]
    assert trimmed and {c.spec.vocab_size for c in trimmed} <= {2048, 1024, 512, 256}
    for candidate in trimmed[:3]:
        vocab = candidate.spec.vocab_size
        spec = StudentSpec(candidate.spec.num_layers, 64, candidate.spec.intermediate_size, 8, 4)
        total, non_embedding = transformers_counts(teacher.replace(vocab_size=vocab), spec)
        assert (candidate.parameters, candidate.non_embedding) == (total, non_embedding)
