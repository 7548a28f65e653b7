"""What the suite's tests share with the multi-host evaluation (tests/multihost_eval_checks.py): the suite settings
and documents, a tiny Gemma 2, and greedy decoding two ways (full forwards, and `generate` as a recipe binds it)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.evaluation.suite_scoring import SuiteSettings
from nnx_surgery.distill.inputs.byte_tokenizer import VOCAB_SIZE
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.generation import generate
from nnx_surgery.surgery.modeling.causal_lm import create_model

FAST_COMPILE = {"xla_backend_optimization_level": 0}
SETTINGS = SuiteSettings(prompts=3, prompt_tokens=40, min_prompt_tokens=8, new_tokens=12, choice_items=6,
                         distractors=3, context_tokens=40, line_tokens=24, score_batch=8, vocab_chunk=96)
DOCUMENTS = [
    "def add(a, b):\n    total = a + b\n    return total\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    if name.endswith('.py'):\n"
    "        print(name, file=sys.stderr)\n",
    "# a comment line\nvalues = [1, 2, 3]\nsquares = [v * v for v in values]\nassert sum(squares) == 14\n",
    "while True:\n    line = input()\n    if not line:\n        break\n    print(line.upper())\n",
]


def tiny_gemma(layers: int, seed: int):
    config = ModelConfig.from_hf_dict(dict(
        model_type="gemma2", vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        attn_logit_softcapping=20.0, final_logit_softcapping=15.0))
    model = create_model(config, seed=seed)
    state = nnx.state(model, nnx.Param)  # scaled up: confident, distinct next-token preferences
    nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, state))
    return model


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding with full forwards over a right-padded buffer (causal: padding after a row's end is never
    seen by its predictions): the plain reference for the `generate` argument."""
    graph, state = nnx.split(model)
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), lengths.max() + new_tokens), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    rows = jnp.arange(len(prompts))

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(state, ids, lengths):
        net = nnx.merge(graph, state)

        def body(i, ids):
            logits = net(ids).logits
            return ids.at[rows, lengths + i].set(jnp.argmax(logits[rows, lengths + i - 1], -1).astype(jnp.int32))

        return jax.lax.fori_loop(0, new_tokens, body, ids)

    out = np.asarray(run(state, ids, lengths))
    return [out[r, n:n + new_tokens].tolist() for r, n in enumerate(lengths)]


def surgery_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The `generate` argument as a recipe binds it."""
    return generate(model, prompts, max_new_tokens=new_tokens).tokens
