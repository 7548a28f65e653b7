"""An lm-evaluation-harness backend for our NNX models: `lm_eval.simple_evaluate(model="nnx-surgery", ...)`.

    import lm_eval, nnx_surgery.evaluation.lm_eval_backend          # importing this module registers "nnx-surgery"
    lm_eval.simple_evaluate(model="nnx-surgery", model_args="pretrained=runs/x/student,dtype=float32",
                            tasks=["hellaswag"], batch_size=16)

`pretrained` is anything the recipe's `--teacher` reads: a model folder (a trimmed-vocabulary student with its own
tokenizer.json included), a `.gguf` file, `gguf:gemma3-270m` or a Hub id. Other model_args: `dtype` (default: the
checkpoint's), `mesh` (e.g. `fsdp=4`; write `fsdp=4+tp=2` for several axes, since lm-eval splits model_args on
commas), `max_length` (default: config.json's max_position_embeddings, as lm-eval's `hf` backend reads it),
`batch_size` (lm-eval's own flag; "auto" is 16 here).

It follows lm-eval's `hf` backend request by request, so the two agree on the same folder
(tests/evaluation/test_lm_eval_backend.py):
the same tokenization (lm-eval's `TemplateLM` splits context and continuation; BOS as transformers adds it), the
same left truncation to `max_length`, the same rolling windows (lm-eval's own `get_rolling_token_windows`), and
greedy generation with stop strings cut as lm-eval cuts them. What differs is the engine: requests of similar length
are sorted by length, batched and padded to a few bucket shapes, so each (batch, bucket) compiles once, and one
jitted function scores a batch (nnx_surgery/evaluation/lm_eval_scoring.py): only the continuation's positions go through the
LM head, and log-probabilities and greedy flags come back, never the logits. Requests that share their context (the
choices of a multiple-choice question) run the context once into a KV cache and each continuation from it (on one
device; a call holds at most batch_size continuations; rolling windows are scored alone).

lm-eval is an optional dependency (`pip install 'nnx-surgery[lm-eval]'`); nothing else in the package imports it.
lm-eval's command line has no way to load a model class from another package (its `--include_path` adds tasks only),
so `python -m nnx_surgery.evaluation.lm_eval_backend ARGS` runs lm-eval's own command line with this backend registered:

    python -m nnx_surgery.evaluation.lm_eval_backend run --model nnx-surgery --model_args pretrained=student/ --tasks arc_easy
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, TypeVar

try:
    # lm-eval's own backends first: its registry fills itself only while it is empty
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:
    raise ImportError("nnx_surgery.evaluation.lm_eval_backend needs lm-evaluation-harness, which is not installed; "
                      "pip install 'nnx-surgery[lm-eval]'") from None

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.evaluation.lm_eval_scoring import (bucket_for, length_buckets, picks_of, score_batch,
                                                    score_shared_contexts, scoring_rows)
from nnx_surgery.refusals import RecipeError
from nnx_surgery.distill.mesh import data_split, make_mesh
from nnx_surgery.surgery.modeling.generation import TextCodec, generate
from nnx_surgery.model_inputs import teacher_source
from nnx_surgery import surgery

DEFAULT_BATCH = 16
DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when neither config.json nor the tokenizer states a length
TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no limit" model_max_length


class LMEvalBackendError(ValueError):
    """A model_args value or model folder the backend cannot use; the message says which and why."""


# ------------------------------------------------------------------------------------------------ tokenizer
class FolderTokenizer:
    """The folder's tokenizer.json through `tokenizers`, encoding as transformers' fast tokenizer does for lm-eval
    (`add_special_tokens` adds BOS where the folder's tokenizer config says so) and decoding without special
    tokens. No transformers needed: lm-eval's base install does not bring it."""

    def __init__(self, folder: str):

        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise LMEvalBackendError(f"pretrained={folder}: no tokenizer.json there; lm-eval feeds text, so the model "
                                     "folder needs its tokenizer (folders from prune, distill, compress and "
                                     "import-gguf have one).")
        self.codec = TextCodec.of(folder)
        self.tokenizer = self.codec.tokenizer
        self.bos_id, self.eos_id, self.pad_id = self.codec.bos_id, self.codec.eos_id, self.codec.pad_id
        self.model_max_length = _json(os.path.join(folder, "tokenizer_config.json")).get("model_max_length")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens:
            return self.codec.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(ids)] if isinstance(ids, (int, np.integer)) else [int(i) for i in ids]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


Result = TypeVar("Result")


def _every_one(results: list[Result | None]) -> list[Result]:
    """The results of every request, each set by one of the batches."""
    if any(result is None for result in results):
        raise LMEvalBackendError("a request was left without a result.")
    return [result for result in results if result is not None]


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _register_once(cls):
    """`register_model("nnx-surgery")`, once: `python -m nnx_surgery.evaluation.lm_eval_backend` runs this file as __main__,
    and a later `import nnx_surgery.evaluation.lm_eval_backend` would otherwise register the class again (an error in lm-eval)."""
    from lm_eval.api.registry import model_registry
    return cls if "nnx-surgery" in model_registry else register_model("nnx-surgery")(cls)


@_register_once
class NNXSurgeryLM(TemplateLM):
    """lm-eval's LM over `surgery.load_pretrained(pretrained)`; see the module's docstring."""

    def __init__(self, pretrained: str | None = None, dtype: str | None = None, mesh: Any = None,
                 batch_size: int | str | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 max_batch_size: int | None = None, device: str | None = None, *, model: Any = None,
                 tokenizer: str | None = None, **unused: Any):
        """lm-eval's model_args (`pretrained`: a folder to load), or from Python an in-memory `model` (a CausalLM,
        e.g. a student mid-run, before any folder exists) with the folder of its `tokenizer`; `mesh`: a spec such
        as "fsdp=4", or the Mesh an in-memory model is on."""
        super().__init__()

        if (model is None) == (pretrained is None):
            raise LMEvalBackendError("give pretrained=FOLDER (lm-eval's model_args), or model= an in-memory model "
                                     "with tokenizer= its tokenizer's folder.")
        if model is not None and not tokenizer:
            raise LMEvalBackendError("model= (an in-memory model) needs tokenizer=, the folder of its tokenizer.json.")
        self.folder: str = resolve_model_folder(str(pretrained)) if model is None else os.path.abspath(str(tokenizer))
        self.tok = FolderTokenizer(self.folder)
        self.mesh = _mesh(mesh) if mesh is None or isinstance(mesh, str) else mesh
        self.model = surgery.load_pretrained(self.folder, dtype=dtype, mesh=self.mesh) if model is None else model
        self.config = self.model.config
        self._batch = _batch_size(batch_size, self.mesh)
        self._max_length = int(max_length) if max_length else self._config_max_length()
        self._max_gen_toks = int(max_gen_toks)
        self.stop_ids = _eos_ids(self.folder, self.config)
        self.graphdef, self.state = nnx.split(self.model)
        self.buckets = length_buckets(self._max_length)
        self.batch_sizes: dict = {}
        self.timings = {"loglikelihood_s": 0.0, "generate_s": 0.0}

    def _config_max_length(self) -> int:
        value = self.config.raw.get("max_position_embeddings")
        if value:
            return int(value)
        limit = self.tok.model_max_length
        return int(limit) if limit and int(limit) < TOKENIZER_INFINITY else DEFAULT_MAX_LENGTH

    # lm-eval's TemplateLM protocol ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if self.tok.eos_id is None:
            raise LMEvalBackendError(f"{self.folder}: the tokenizer names no EOS token, which lm-eval needs.")
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def tokenizer_name(self) -> str:
        return self.folder.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_name": self.folder, "model_dtype": str(self.model.dtype),
                "model_num_parameters": int(sum(np.prod(v.shape) for v in jax.tree.leaves(self.state)))}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        """As the hf backend: special tokens unless asked otherwise, none when the text already starts with BOS."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok.decode([self.prefix_token_id], False))
        ids = self.tok.encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None, share: bool = True,
                              ) -> list[tuple[float, bool]]:
        """(request, context ids, continuation ids) -> (log-probability of the continuation, is it greedy).
        `share`: score the choices of one context from one pass over it (`_shared_contexts`)."""
        started = time.perf_counter()
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for chunk in self._shared_calls(self._shared_contexts(requests) if share and self.mesh is None else []):
            totals, greedy = self._score_shared_batch([[requests[i] for i in group] for group in chunk])
            for group, group_totals, group_greedy in zip(chunk, totals, greedy):
                for i, total, flag in zip(group, group_totals, group_greedy):
                    results[i] = (float(total), bool(flag))
        alone = [i for i in range(len(requests)) if results[i] is None]
        rows = {i: scoring_rows(requests[i][1], requests[i][2], self.max_length) for i in alone}
        order = sorted(alone, key=lambda i: (-len(rows[i][0]), rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            batch_totals, batch_greedy = self._score_batch([rows[i] for i in batch])
            for i, total, flag in zip(batch, batch_totals, batch_greedy):
                results[i] = (float(total), bool(flag))
        for request, result in zip(requests, results):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        self.timings["loglikelihood_s"] += time.perf_counter() - started
        return _every_one(results)

    def _shared_contexts(self, requests) -> list[list[int]]:
        """Indices of requests grouped by their context (2 or more with the same context ids), longest contexts
        first, where context and continuation fit untruncated in the model's positions (sliding-window layers keep
        a ring in the cache, which a continuation of several tokens continues as a chunk); every other request is
        scored alone."""
        groups: dict[tuple, list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if context and continuation and len(context) + len(continuation) <= self.max_length:
                groups.setdefault(tuple(context), []).append(i)
        pieces = [group[start:start + self.batch_size] for group in groups.values()  # a call's rows: batch_size
                  for start in range(0, len(group), self.batch_size)]
        shared = [piece for piece in pieces if len(piece) >= 2]
        return sorted(shared, key=lambda group: (-len(requests[group[0]][1]), group))

    def _shared_calls(self, groups: list[list[int]]) -> list[list[list[int]]]:
        """Groups packed into calls of at most batch_size continuations: contexts x their most choices."""
        calls: list[list[list[int]]] = []
        for group in groups:
            if calls and (len(calls[-1]) + 1) * max(len(group), *map(len, calls[-1])) <= self.batch_size:
                calls[-1].append(group)
            else:
                calls.append([group])
        return calls

    def _score_shared_batch(self, groups) -> tuple[list, list]:
        """One `score_shared_contexts` call: `groups` (lists of (request, context, continuation) with one context
        each, `_shared_calls`) as (R, W) left-padded contexts and (R, C, K) continuations, W and K length buckets,
        C the most choices of a group, R = batch_size // C; unused rows and choices weigh nothing."""
        width = bucket_for(max(len(group[0][1]) for group in groups), self.buckets)
        k = bucket_for(max(len(c) for group in groups for _, _, c in group), self.buckets)
        choices = max(len(group) for group in groups)
        rows = self.batch_size // choices  # contexts per call: rows x choices continuations, at most batch_size
        contexts, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        inputs = np.zeros((rows, choices, max(k - 1, 1)), np.int32)
        targets = np.zeros((rows, choices, k), np.int32)
        weights = np.zeros((rows, choices, k), np.float32)
        mask[len(groups):, -1] = 1  # unused rows: one real token, so that no position attends to nothing
        for r, group in enumerate(groups):
            context = group[0][1]
            contexts[r, width - len(context):], mask[r, width - len(context):] = context, 1
            for c, (_, _, continuation) in enumerate(group):
                inputs[r, c, :len(continuation) - 1] = continuation[:-1]
                targets[r, c, :len(continuation)] = continuation
                weights[r, c, :len(continuation)] = 1.0
        arrays = [self._place(a) for a in (contexts, mask, inputs, targets)]
        picks = [self._place(a, replicated=True) for a in picks_of(weights)]
        totals, greedy = score_shared_contexts(self.graphdef, self.state, *arrays, *picks)
        totals, greedy = np.asarray(totals), np.asarray(greedy)
        return ([totals[r, :len(group)] for r, group in enumerate(groups)],
                [greedy[r, :len(group)] for r, group in enumerate(groups)])

    def _score_batch(self, rows: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
        """One padded (batch_size, bucket) call: inputs are tokens[:-1]; the last `scored` positions of each row
        predict tokens[1:] there (the continuation), gathered into (batch_size, K bucket) arrays."""
        width = bucket_for(max(len(tokens) - 1 for tokens, _ in rows), self.buckets)
        k = bucket_for(min(max(scored for _, scored in rows), width), [*self.buckets, width])
        k = min(k, width)
        ids = np.zeros((self.batch_size, width), np.int32)
        scored_at, targets = np.zeros((self.batch_size, k), np.int32), np.zeros((self.batch_size, k), np.int32)
        weights = np.zeros((self.batch_size, k), np.float32)
        for r, (tokens, scored) in enumerate(rows):
            n = len(tokens) - 1
            scored = min(scored, n)  # a continuation longer than the context window: its tail
            ids[r, :n] = tokens[:-1]
            scored_at[r, :scored] = np.arange(n - scored, n)
            targets[r, :scored] = tokens[n - scored + 1:]
            weights[r, :scored] = 1.0
        arrays = [self._place(a) for a in (ids, scored_at, targets)]
        picks = [self._place(a, replicated=True) for a in picks_of(weights)]
        totals, greedy = score_batch(self.graphdef, self.state, *arrays, *picks)
        return np.asarray(totals)[:len(rows)], np.asarray(greedy)[:len(rows)]

    def _place(self, array: np.ndarray, replicated: bool = False):
        """On the mesh: split over its data axes by the first dimension (rows), or `replicated`."""
        if self.mesh is None:
            return jnp.asarray(array)
        from jax.sharding import NamedSharding, PartitionSpec
        axes, _ = data_split(self.mesh)
        spec = PartitionSpec() if replicated else PartitionSpec(tuple(axes) or None)
        return jax.device_put(array, NamedSharding(self.mesh, spec))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability over windows of the model's context, lm-eval's own windows (the first
        conditioned on the prefix token, each later one on as much earlier text as fits)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, predicted))
                owners.append(index)
        totals = [0.0] * len(requests)
        # a document's windows never share a context worth a pass (the first ones share the prefix token alone)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, share=False)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (`surgery.generate`'s KV-cached prefill and decode loop at fixed shapes),
        batched among requests with the same generation settings, longest prompts first, cut at the first stop
        string as lm-eval cuts them."""
        started = time.perf_counter()
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(index)
        results: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            prompts = {i: self._prompt(requests[i].args[0], settings) for i in indices}
            indices = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                for i, text in zip(chunk, self._generate([prompts[i] for i in chunk], settings)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self.timings["generate_s"] += time.perf_counter() - started
        return _every_one(results)

    def _prompt(self, context: str, settings: dict) -> list[int]:
        budget = self.max_length - self._gen_settings(settings)[1]
        if budget <= 0:
            raise LMEvalBackendError(f"max_gen_toks={self._gen_settings(settings)[1]} leaves no room for the prompt "
                                     f"in the model's {self.max_length} positions.")
        return self.tok_encode(context)[-budget:]

    def _gen_settings(self, settings: dict) -> tuple[list[str], int]:
        kwargs = normalize_gen_kwargs(dict(settings), self.max_gen_toks)
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
            raise LMEvalBackendError(f"generation settings {settings}: only greedy decoding is supported "
                                     "(do_sample=false, temperature=0), as lm-eval's generative tasks use.")
        until = handle_stop_sequences(kwargs.get("until"), eos=self.tok.decode([self.eot_token_id], False))
        return until, int(kwargs["max_gen_toks"])

    def _generate(self, prompts: list[list[int]], settings: dict) -> list[str]:
        until, max_gen_toks = self._gen_settings(settings)
        strings = [s for s in until if s and s != self.tok.decode([self.eot_token_id], False)]
        # fixed (batch, width bucket) shapes: the prefill and decode loop compile once per bucket
        kept = generate(self.model, prompts, max_new_tokens=max_gen_toks, stop=[*self.stop_ids, *strings],
                        tokenizer=self.tok.codec, pad_to=bucket_for(max(map(len, prompts)), self.buckets),
                        batch_rows=self.batch_size).tokens
        return [postprocess_generated_text(self.tok.decode(tokens), until, None) for tokens in kept]


# ------------------------------------------------------------------------------------------------ arguments
def resolve_model_folder(pretrained: str) -> str:
    """A local HF folder for `pretrained` (what the recipe's --teacher reads), or an LMEvalBackendError."""
    if os.path.isdir(pretrained) and not os.path.isfile(os.path.join(pretrained, "config.json")):
        raise LMEvalBackendError(f"pretrained={pretrained}: no config.json there, so it is not a model folder; give "
                                 "a Hugging Face model folder, a .gguf file, gguf:gemma3-270m or a Hub id.")
    try:
        return os.path.abspath(teacher_source(pretrained, "pretrained="))
    except RecipeError as error:
        raise LMEvalBackendError(str(error).replace("pretrained= ", "pretrained=", 1)) from None


def _mesh(spec: str | None):
    if not spec:
        return None
    return make_mesh(str(spec).replace("+", ",").replace(";", ","))


def _batch_size(value, mesh) -> int:
    """lm-eval's batch_size (an int, "auto" or "auto:N"; auto is DEFAULT_BATCH here), rounded up to a multiple of
    the mesh's data split so every device gets rows."""
    text = str(value) if value is not None else "auto"
    size = DEFAULT_BATCH if text.startswith("auto") else int(text)
    if size < 1:
        raise LMEvalBackendError(f"batch_size={value}: give a positive number of rows (or auto).")
    if mesh is not None:
        split = data_split(mesh)[1]
        size = -(-size // split) * split
    return size


def _eos_ids(folder: str, config) -> list[int]:
    """The ids transformers' generate stops on: generation_config.json's eos_token_id, else config.json's."""
    eos = _json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    if eos is None:
        eos = config.raw.get("eos_token_id")
    return [] if eos is None else [int(e) for e in np.atleast_1d(eos)]


if __name__ == "__main__":
    import importlib

    from lm_eval.__main__ import cli_evaluate
    importlib.import_module("nnx_surgery.evaluation.lm_eval_backend")  # what a task's own code imports finds registered
    cli_evaluate()
