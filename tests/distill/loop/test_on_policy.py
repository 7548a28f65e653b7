"""On-policy distillation (GKD): JSD(beta) end points, masking of sampled rows against a numpy reference, the
KV-cache sampler, lambda = 0 / lambda = 1 runs, resume, and the tiny-teacher experiment (on-policy training
lowers the KL on the student's own samples more than off-policy training at equal steps)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, LossWeights, Stage
from nnx_surgery.distill.interface import next_token_targets
from nnx_surgery.distill.losses.divergence import LogitLossSettings, reference_logit_loss
from nnx_surgery.distill.loop.on_policy import OnPolicyConfig, completion_rows, on_policy_at, prompts
from nnx_surgery.distill.loop.trainer import run
from nnx_surgery.surgery.modeling.generation import _decode, _prefill, completion_mask, generate, make_sampler
from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, ArrayBatches, student_from, teacher_samples, tiny_teacher

PROMPT = 8  # prompt area of the LENGTH = 16 rows; 8 tokens are sampled
JSD = LossWeights(kl=0.0, jsd=1.0)


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher()


@pytest.fixture(scope="module")
def data(teacher):
    """Teacher continuations as prompt/completion rows: the loss on the last 8 tokens only (GKD's off-policy data)."""
    batches = teacher_samples(teacher, 20, seed=1)
    mask = np.zeros((BATCH, LENGTH), np.float32)
    mask[:, PROMPT - 1:LENGTH - 1] = 1.0
    return {"train": [{**b, "loss_mask": mask} for b in batches[:16]], "held": batches[16:]}


@pytest.fixture(scope="module")
def sampler():
    return make_sampler()


def _config(steps=4, fraction=0.0, **changes):
    return DistillConfig(**{**dict(stages=(Stage(steps=steps, learning_rate=1e-2, weights=JSD),), batch_size=BATCH,
                                   seq_len=LENGTH, progress=False, logit_chunk=16, compiler_options=FAST_COMPILE,
                                   on_policy=OnPolicyConfig(fraction=fraction, prompt_len=PROMPT)), **changes})


# ------------------------------------------------------------------------------------------------ losses, config
def _jsd(beta, s, t):
    spec = LogitLossSettings(kl=False, jsd=True, jsd_beta=beta)
    coeffs = dict(temperature=1.0, kl=0.0, reverse_kl=0.0, jsd=1.0, ce=0.0)
    return float(reference_logit_loss(jnp.asarray([s]), jnp.asarray([t]), jnp.zeros(1, jnp.int32), jnp.ones(1),
                                      coeffs, spec)[0])


def test_generalised_jsd_end_points_are_forward_and_reverse_kl():
    s, t = [0.3, -1.0, 2.0], [1.5, 0.0, -0.5]
    p, q = np.exp(t) / np.exp(t).sum(), np.exp(s) / np.exp(s).sum()
    forward, reverse = float(np.sum(p * np.log(p / q))), float(np.sum(q * np.log(q / p)))
    assert _jsd(0.0, s, t) == pytest.approx(forward, rel=1e-5)
    assert _jsd(1.0, s, t) == pytest.approx(reverse, rel=1e-5)
    # the end points are the limits of JSD(beta) / beta and JSD(beta) / (1 - beta)
    assert _jsd(1e-3, s, t) / 1e-3 == pytest.approx(forward, rel=2e-2)
    assert _jsd(1 - 1e-3, s, t) / 1e-3 == pytest.approx(reverse, rel=2e-2)
    with pytest.raises(ValueError, match="jsd_beta"):
        LogitLossSettings(jsd=True, jsd_beta=1.5)
    with pytest.raises(ValueError, match="reverse KL"):
        LogitLossSettings(jsd=True, jsd_beta=1.0, top_k=4)


def test_config_reads_on_policy_and_refuses_bad_values():
    config = DistillConfig.from_dict({"on_policy": {"fraction": 0.5, "temperature": 0.7}, "jsd_beta": 0.0})
    assert config.on_policy == OnPolicyConfig(fraction=0.5, temperature=0.7)
    assert DistillConfig.from_dict(config.to_dict()) == config
    assert DistillConfig(on_policy={"fraction": 0.25}).on_policy == OnPolicyConfig(fraction=0.25)
    assert OnPolicyConfig().shape(16) == (8, 8) and OnPolicyConfig(prompt_len=4, max_new_tokens=6).shape(16) == (4, 6)
    for bad in ({"fraction": 1.5}, {"temperature": -1.0}, {"prompt_len": 0}):
        with pytest.raises(ValueError, match="OnPolicyConfig"):
            OnPolicyConfig(**bad)
    with pytest.raises(ValueError, match="must fit"):
        DistillConfig(seq_len=16, on_policy=OnPolicyConfig(fraction=0.5, prompt_len=12, max_new_tokens=8))
    with pytest.raises(ValueError, match="unknown keys"):
        DistillConfig.from_dict({"on_policy": {"lambda": 0.5}})


# ------------------------------------------------------------------------------------------------ masking
def _reference_rows(ids, loss_mask, real, tokens, valid, width):
    """Row by row, plainly: the prompt (leading unsupervised tokens, else `width`), the completion through the
    first invalid token, then zeros; the loss on the completion's predictions only."""
    out_ids, out_mask = np.zeros_like(ids), np.zeros(ids.shape, np.float32)
    out_real = np.zeros_like(ids)
    for b in range(ids.shape[0]):
        first = next((t for t in range(ids.shape[1]) if loss_mask[b, t] > 0), 0)
        area = min(first + 1, width) if first >= 1 else width
        prompt = [int(ids[b, t]) for t in range(area) if real[b, t]]
        completion = []
        for token, ok in zip(tokens[b], valid[b]):
            if not ok:
                break
            completion.append(int(token))
        row = prompt + completion
        out_ids[b, :len(row)] = row
        out_real[b, :len(row)] = 1
        for t in range(len(prompt) - 1, len(row) - 1):
            out_mask[b, t] = 1.0
    return out_ids, out_mask, out_real


def test_sampled_rows_are_masked_like_the_numpy_reference():
    eos = pad = 1  # pad == eos: the EOS label must survive
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 50, (4, 12)).astype(np.int32)
    loss_mask = np.ones((4, 12), np.float32)
    loss_mask[1, :3] = 0.0  # row 1: a prompt/completion record, prompt = tokens 0..3
    loss_mask[2, :9] = 0.0  # row 2: a prompt longer than the area: cut to it
    attention = np.ones((4, 12), np.int32)
    attention[3, :2] = 0  # row 3: left padding inside the prompt area
    ids[3, :2] = pad
    tokens = rng.integers(2, 50, (4, 6)).astype(np.int32)
    tokens[0, 2], tokens[0, 3:] = eos, pad  # stops at its third token; filler = pad = eos after it
    tokens[1, 0] = eos  # stops at once: only the EOS is a completion token
    tokens[3, 4] = eos
    valid = completion_mask(tokens, 6, [eos])
    assert valid[0].tolist() == [True] * 3 + [False] * 3 and valid[1].tolist() == [True] + [False] * 5
    assert valid[2].all() and valid[3].tolist() == [True] * 5 + [False]
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention,
             "positions": np.tile(np.arange(12, dtype=np.int32), (4, 1)), "segment_ids": attention.copy()}
    rows, padded, mask = prompts(batch, 6)
    assert [len(r) for r in rows] == [6, 4, 6, 4]
    assert padded[1].tolist() == [0, 0] + ids[1, :4].tolist() and mask[1].tolist() == [0, 0, 1, 1, 1, 1]
    assert padded[3, 2:].tolist() == ids[3, 2:6].tolist() and mask[3].tolist() == [0, 0, 1, 1, 1, 1]
    out = completion_rows(batch, rows, tokens, valid)
    want_ids, want_mask, want_real = _reference_rows(ids, loss_mask, attention, tokens, valid, 6)
    np.testing.assert_array_equal(out["input_ids"], want_ids)
    np.testing.assert_array_equal(out["loss_mask"], want_mask)
    np.testing.assert_array_equal(out["attention_mask"], want_real)
    np.testing.assert_array_equal(out["segment_ids"], want_real)
    np.testing.assert_array_equal(out["positions"], np.where(want_real > 0, np.arange(12), 0))
    # what the step scores: exactly the completion's tokens, EOS included although it equals the pad id
    labels, weights, _ = next_token_targets({k: jnp.asarray(v) for k, v in out.items()})
    scored = [np.asarray(labels)[b][np.asarray(weights)[b] > 0].tolist() for b in range(4)]
    assert scored == [tokens[0, :3].tolist(), [eos], tokens[2].tolist(), tokens[3, :5].tolist()]
    assert scored[0][-1] == pad


def test_sampler_is_greedy_generate_and_compiles_once(teacher):
    student = student_from(teacher)  # the graph the runs below sample: they reuse these programs
    sampler = make_sampler(stop=[5])
    ids = np.array([[0, 0, 7, 8], [3, 4, 5, 6]], np.int32)
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], np.int32)
    tokens, valid = sampler(student, ids, mask, max_new_tokens=6, temperature=0.0, key=jax.random.key(0))
    reference = generate(student, [[7, 8], [3, 4, 5, 6]], max_new_tokens=6, stop=[5]).tokens
    assert [row[v].tolist() for row, v in zip(tokens, valid)] == reference
    sizes = (_prefill._cache_size(), _decode._cache_size())
    model = nnx.merge(*nnx.split(student))  # a module merged from the same graph: the same programs
    for seed in range(3):
        sampler(model, ids, mask, max_new_tokens=6, temperature=1.0, key=jax.random.key(seed))
    assert (_prefill._cache_size(), _decode._cache_size()) == (sizes[0] + 1, sizes[1] + 1)  # sampled, not greedy


# ------------------------------------------------------------------------------------------------ runs
class OwnContinuation:
    """A sampler that 'samples' the data's own continuation of each prompt: the on-policy batch is then the data's."""

    def __init__(self, batches):
        self.rows = np.concatenate([b["input_ids"] for b in batches])

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, key):
        match = [int(np.flatnonzero((self.rows[:, :PROMPT] == p).all(1))[0]) for p in prompt_ids]
        tokens = self.rows[match, PROMPT:PROMPT + max_new_tokens]
        return tokens, np.ones(tokens.shape, bool)


def test_lambda_zero_is_the_off_policy_loss_and_scored_samples_match_it(teacher, data, sampler):
    off = run(teacher, student_from(teacher), data["train"], _config(on_policy=OnPolicyConfig()))
    zero = run(teacher, student_from(teacher), data["train"], _config(fraction=0.0), sampler=sampler)
    assert [r["loss"] for r in zero.history] == [r["loss"] for r in off.history]
    assert "on_policy" not in zero.history[0]
    # lambda = 1 with samples equal to the data: the same batches, the same losses, bit for bit
    same = run(teacher, student_from(teacher), data["train"], _config(fraction=1.0),
               sampler=OwnContinuation(data["train"]))
    assert [r["on_policy"] for r in same.history] == [1] * 4
    assert [r["loss"] for r in same.history] == [r["loss"] for r in off.history]
    assert [r["supervised_tokens"] for r in same.history] == [BATCH * (LENGTH - PROMPT)] * 4
    with pytest.raises(ValueError, match="sampler"):
        run(teacher, student_from(teacher), data["train"], _config(fraction=0.5))


def test_draws_are_seeded_every_batch_at_lambda_one_and_restored_on_resume(teacher, data, sampler, tmp_path):
    every = run(teacher, student_from(teacher), data["train"], _config(steps=3, fraction=1.0), sampler=sampler)
    assert [r["on_policy"] for r in every.history] == [1, 1, 1]
    assert all(r["sample_s"] > 0 for r in every.history) and every.history[-1]["on_policy_rate"] == 1.0
    assert any(e["event"] == "on_policy" for e in every.events)

    compiled = (_prefill._cache_size(), _decode._cache_size())  # the runs below sample with these programs
    config = _config(steps=6, fraction=0.5, seed=3)
    full = run(teacher, student_from(teacher), ArrayBatches(data["train"]), config, sampler=sampler)
    flags = [r["on_policy"] for r in full.history]
    assert flags == [int(on_policy_at(3, step, 0.5)) for step in range(6)] and 0 < sum(flags) < 6
    checkpoint = CheckpointConfig(str(tmp_path / "ckpt"), every=3)
    student = student_from(teacher)
    run(teacher, student, ArrayBatches(data["train"]), _config(steps=6, fraction=0.5, seed=3, halt_after=3,
                                                                checkpoint=checkpoint), sampler=sampler)
    resumed = run(teacher, student, ArrayBatches(data["train"]),
                  _config(steps=6, fraction=0.5, seed=3, checkpoint=checkpoint), sampler=sampler)
    assert resumed.events[0]["event"] == "resume"
    assert [r["on_policy"] for r in resumed.full_history] == flags
    assert (_prefill._cache_size(), _decode._cache_size()) == compiled  # no recompilation, step after step
    assert [r["loss"] for r in resumed.history] == pytest.approx([r["loss"] for r in full.history[3:]], rel=1e-6)


def _own_sample_kl(teacher, student, held, sampler) -> float:
    """KL(teacher || student) per completion token on the student's own samples (temperature 1) of held-out
    prompts, two draws per prompt."""
    (t_graph, t_state), (s_graph, s_state) = nnx.split(teacher), nnx.split(student)

    @jax.jit
    def kl_sums(t_state, s_state, batch):
        log_p = jax.nn.log_softmax(nnx.merge(t_graph, t_state)(batch["input_ids"]).logits)
        log_q = jax.nn.log_softmax(nnx.merge(s_graph, s_state)(batch["input_ids"]).logits)
        _, weights, _ = next_token_targets(batch)
        return jnp.sum(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1) * weights), jnp.sum(weights)

    total = count = 0.0
    for i, batch in enumerate(held):
        for draw in range(2):
            rows, ids, mask = prompts(batch, PROMPT)
            tokens, valid = sampler(student, ids, mask, max_new_tokens=LENGTH - PROMPT, temperature=1.0,
                                    key=jax.random.key(1000 + 10 * i + draw))
            sums = kl_sums(t_state, s_state, {k: jnp.asarray(v) for k, v in
                                              completion_rows(batch, rows, tokens, valid).items()})
            total, count = total + float(sums[0]), count + float(sums[1])
    return total / count


def test_on_policy_lowers_the_kl_on_own_samples_more_than_off_policy(teacher, data, sampler):
    """48 steps of JSD(0.5) on the same prompts: the teacher's completions (off-policy) against the student's own
    (lambda = 1). Measured KL on the student's samples: 0.553 before, 0.376 off-policy, 0.357 on-policy
    (reductions 0.177 and 0.196: ratio 1.11). Over other seeds (run seed 1, 2; teachers and data 1-3) the ratio
    was 1.13, 1.22, 1.04, 1.23, 1.06: on-policy always gained more, by 4-23 %; the seeds here are fixed."""
    before = _own_sample_kl(teacher, student_from(teacher), data["held"], sampler)
    after = {}
    for fraction in (0.0, 1.0):
        student = student_from(teacher)
        run(teacher, student, ArrayBatches(data["train"]), _config(steps=48, fraction=fraction), sampler=sampler)
        after[fraction] = _own_sample_kl(teacher, student, data["held"], sampler)
    off, on = before - after[0.0], before - after[1.0]
    assert off > 0 and math.isfinite(on)
    assert on > 1.05 * off, (before, after)
