"""GGUF headers that make no sense (issue 43): zero, negative, huge, fractional or non-finite sizes, epsilons,
RoPE bases and windows, from a table and made by hypothesis, are refused by `import-gguf` and by `plan` (which
imports a .gguf teacher) in one line naming the key, with nothing written and no traceback. The files hold only a
header (and a few tensors no model has): a sound header is refused for its missing tensors instead, so a refusal
naming the key is the header's."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from refusal_env import SPEC, refused


@pytest.fixture
def w(tmp_path, monkeypatch):
    """An empty workspace (outputs go there) and the GGUF cache beside it, for `refused`."""
    base = tmp_path / "workspace"
    base.mkdir()
    monkeypatch.setenv("NNX_SURGERY_CACHE", str(tmp_path / "cache"))
    return dict(base=base, cache=str(tmp_path / "cache" / "gguf"))


ARCH = "gemma3"
GOOD_HEADER = {"context_length": 128, "embedding_length": 32, "block_count": 2, "feed_forward_length": 48,
               "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 12,
               "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6, "attention.sliding_window": 5}
BAD_VALUES = (0, -1, -(2 ** 31), 2 ** 40, float("inf"), float("-inf"), float("nan"), 0.5)


def header_gguf(path, **changes) -> str:
    """A GGUF holding only a header: the tiny teacher's keys with `changes` (integers as int64/uint64, others as
    float64). With no change it is refused for its missing tensors, so a refusal naming the key is the header's."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    for key, value in {**GOOD_HEADER, **changes}.items():
        name = f"{ARCH}.{key}"
        if isinstance(value, float):
            writer.add_float64(name, value)
        elif value < 0:
            writer.add_int64(name, value)
        else:
            writer.add_uint64(name, value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(40)])
    for index in range(8):  # a file's tensors bound its block count; these are no model's
        writer.add_tensor(f"unused.{index}", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_sound_header_gets_as_far_as_the_tensors(w, tmp_path):
    refused(w, ["import-gguf", header_gguf(tmp_path / "sound.gguf"), str(w["base"] / "out")], "is missing")


@pytest.mark.parametrize("key", sorted(GOOD_HEADER))
@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_a_header_that_makes_no_sense_is_refused_by_import_and_plan(w, tmp_path, key, value):
    if key in ("attention.layer_norm_rms_epsilon", "rope.freq_base") and value == 0.5:
        value = 2.0 if key.endswith("epsilon") else -0.5  # 0.5 is a (large) epsilon and a (small) RoPE base
    path = header_gguf(tmp_path / "bad.gguf", **{key: value})
    refused(w, ["import-gguf", path, str(w["base"] / "out")], key.split(".")[-1])
    if value in (0, float("nan")) or key in ("attention.head_count", "context_length"):
        refused(w, ["plan", path, "--student", SPEC, "--calibration-samples", "0", "-o", str(w["base"] / "p.json")],
                key.split(".")[-1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(GOOD_HEADER)), st.one_of(
    st.integers(-(2 ** 62), 0), st.integers(2 ** 25, 2 ** 62), st.sampled_from([float("inf"), float("nan")]),
    st.floats(-1e30, 0.0)), min_size=1, max_size=4))
def test_generated_headers_are_refused_in_one_line_naming_a_key(w, tmp_path_factory, changes):
    path = header_gguf(tmp_path_factory.mktemp("generated") / "g.gguf", **changes)
    err = refused(w, ["import-gguf", path, str(w["base"] / "out")])
    assert any(key.split(".")[-1] in err for key in changes), (changes, err)
