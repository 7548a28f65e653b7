"""Property-based tests (hypothesis) of the parsers that read what users and files hand us: Gemma config dicts,
plan files, freeze path patterns and mesh specs. Valid inputs round-trip; invalid ones raise the toolkit's own
errors (ConfigError, PlanError, SpecError, MeshError, ValueError from distill's pattern checks), never an
IndexError, KeyError, TypeError or AttributeError from deep inside. Example counts stay small for CI time."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnx_surgery.distill.loop.freeze import expand_braces, pattern_matches
from nnx_surgery.distill.mesh import MeshError, format_mesh_spec, parse_mesh_spec
from nnx_surgery.surgery.modeling.model_config import FULL, SLIDING, ConfigError, ModelConfig
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec

FAST = settings(max_examples=int(__import__("os").environ.get("PROPERTY_EXAMPLES", 60)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


# ------------------------------------------------------------------------------------------------ configs
@st.composite
def gemma_configs(draw) -> dict:
    family = draw(st.sampled_from(["gemma", "gemma2", "gemma3_text"]))
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 4))
    hidden = heads * draw(st.integers(1, 16))
    layers = draw(st.integers(1, 6))
    kinds = [FULL] if family == "gemma" else [FULL, SLIDING]
    data = {"model_type": family, "vocab_size": draw(st.integers(1, 1000)), "hidden_size": hidden,
            "intermediate_size": draw(st.integers(1, 512)), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": draw(st.integers(1, 64)),
            "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])), "tie_word_embeddings": draw(st.booleans()),
            "layer_types": draw(st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers)),
            "final_logit_softcapping": draw(st.none() | st.floats(1, 100))}
    theta = draw(st.floats(100, 1e7))
    if family != "gemma":
        data.update(sliding_window=draw(st.integers(1, 4096)), query_pre_attn_scalar=draw(st.integers(1, 512)))
    if family == "gemma2":
        data["attn_logit_softcapping"] = draw(st.none() | st.floats(1, 100))
    if family == "gemma3_text":
        data["rope_parameters"] = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                   FULL: {"rope_type": draw(st.sampled_from(["default", "linear"])),
                                          "factor": draw(st.floats(1, 8)), "rope_theta": theta}}
    else:
        data["rope_theta"] = theta
    return data


@FAST
@given(gemma_configs())
def test_valid_configs_round_trip(data):
    config = ModelConfig.from_hf_dict(data)
    again = ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict())))
    assert again == config and again.to_hf_dict() == config.to_hf_dict()


@FAST
@given(gemma_configs(), st.data())
def test_broken_configs_raise_config_errors(data, draw):
    key = draw.draw(st.sampled_from(sorted(data) + ["rope_scaling", "sliding_window_pattern", "hidden_activation",
                                                    "text_config", "rope_local_base_freq"]))
    data = {**data, key: draw.draw(JSON)}
    try:
        ModelConfig.from_hf_dict(data)
    except ConfigError as err:
        assert key in str(err) or "config" in str(err)


# ------------------------------------------------------------------------------------------------ plans
TEACHER = ModelConfig.from_hf_dict({"model_type": "gemma2", "vocab_size": 96, "hidden_size": 32,
                                    "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 12, "query_pre_attn_scalar": 20,
                                    "sliding_window": 5})


@st.composite
def plans(draw) -> Plan:
    """A valid plan for TEACHER (KV heads kept whole: 'select'), with random choices everywhere."""
    heads, kv = draw(st.sampled_from([(2, 1), (2, 2), (4, 2)]))
    spec = StudentSpec(draw(st.integers(1, 4)), heads * draw(st.integers(1, 8)), draw(st.integers(1, 48)), heads, kv)
    sample = lambda n, k: sorted(draw(st.permutations(range(n)))[:k])  # noqa: E731
    layers = sample(4, spec.num_layers)
    student = spec.config_for(TEACHER, layers)
    kv_groups, kept_heads = [], []
    for _ in layers:
        groups = [[g] for g in sample(2, kv)]
        kv_groups.append(groups)
        kept_heads.append([sorted(draw(st.permutations([2 * g[0], 2 * g[0] + 1]))[:heads // kv]) for g in groups])
    return Plan(teacher={"source": "t", "revision": None, "config": TEACHER.to_hf_dict()}, spec=spec.to_dict(),
                student_config=student.to_hf_dict(), kept_layers=layers, layer_types=list(student.layer_types),
                kept_hidden=draw(st.permutations(range(32)))[:spec.hidden_size],
                kept_mlp=[sample(48, spec.intermediate_size) for _ in layers], kv_groups=kv_groups,
                kv_weights=[[[1.0] for _ in range(kv)] for _ in layers], kept_heads=kept_heads,
                embed_scale=draw(st.floats(0.5, 2.0)))


@FAST
@given(plans())
def test_valid_plans_round_trip(plan):
    plan.validate()
    assert Plan.from_json(plan.to_json()) == plan


def _leaf_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaf_paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaf_paths(item, path + (index,))


@FAST
@given(plans(), st.data())
def test_hand_edited_plans_raise_plan_errors(plan, draw):
    data = json.loads(plan.to_json())
    paths = [p for p in _leaf_paths(data) if p and p[0] not in ("scores", "methods", "calibration")]
    path = draw.draw(st.sampled_from(paths))
    target = data
    for key in path[:-1]:
        target = target[key]
    if draw.draw(st.booleans()) and isinstance(target, dict):
        del target[path[-1]]
    else:
        target[path[-1]] = draw.draw(JSON | st.integers(-5, 100))
    try:
        Plan.from_json(json.dumps(data))
    except (PlanError, ConfigError, SpecError):
        pass


@FAST
@given(st.text(max_size=40))
def test_any_text_as_a_plan_is_a_plan_error(text):
    with pytest.raises((PlanError, ConfigError, SpecError)):
        Plan.from_json(text)


# ------------------------------------------------------------------------------------------------ meshes
AXIS = st.text(string.ascii_lowercase + "_", min_size=1, max_size=6).filter(str.isidentifier)


@FAST
@given(st.dictionaries(AXIS, st.integers(1, 64), min_size=1, max_size=4))
def test_mesh_specs_round_trip(sizes):
    assert parse_mesh_spec(format_mesh_spec(sizes)) == sizes
    assert parse_mesh_spec(sizes) == sizes
    assert parse_mesh_spec(" , ".join(f" {k} = {v} " for k, v in sizes.items())) == sizes


@FAST
@given(st.text(max_size=30) | st.dictionaries(st.text(max_size=4) | st.integers(), JSON, max_size=3)
       | st.integers() | st.lists(st.text(max_size=3), max_size=3))
def test_bad_mesh_specs_raise_mesh_errors(spec):
    try:
        sizes = parse_mesh_spec(spec)
    except MeshError:
        return
    assert sizes and all(isinstance(v, int) and v >= 1 and k.isidentifier() for k, v in sizes.items())


# ------------------------------------------------------------------------------------------------ freeze patterns
SEGMENT = st.from_regex(r"[a-z_]{1,6}|[0-9]{1,2}", fullmatch=True)


@FAST
@given(st.lists(SEGMENT, min_size=1, max_size=5), st.data())
def test_patterns_match_the_paths_they_describe(segments, draw):
    path = ".".join(segments)
    assert pattern_matches(path, path)
    index = draw.draw(st.integers(0, len(segments) - 1))
    starred = ".".join("*" if i == index else s for i, s in enumerate(segments))
    assert pattern_matches(starred, path)
    assert pattern_matches(".".join(segments[:index + 1]), path)  # a prefix matches everything below it
    other = draw.draw(SEGMENT)
    braced = ".".join("{%s,%s}" % (other, s) if i == index else s for i, s in enumerate(segments))
    assert pattern_matches(braced, path)
    if segments[index].isdigit():
        n = int(segments[index])
        ranged = ".".join("{%d-%d}" % (max(0, n - 1), n + 1) if i == index else s for i, s in enumerate(segments))
        assert pattern_matches(ranged, path) == (str(n) == segments[index])


@FAST
@given(st.text(alphabet=string.printable, max_size=24), st.text(max_size=12))
def test_any_pattern_text_gives_a_bool_or_a_value_error(pattern, path):
    try:
        assert isinstance(pattern_matches(pattern, path), bool)
        assert all(isinstance(p, str) for p in expand_braces(pattern))
    except ValueError:
        pass
