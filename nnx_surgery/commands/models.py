"""`nnx-surgery generate`, `import-gguf`, `export-gguf` and `push`: surgery.generate, surgery.import_gguf,
export.export_gguf and export.push_to_hub on a model folder."""
from __future__ import annotations

import argparse
import os
import sys

from nnx_surgery import export, surgery
from nnx_surgery.commands import resolve_flag_value, shape_line
from nnx_surgery.paths import empty_folder, input_paths, model_folder, new_file
from nnx_surgery.refusals import VARIABLE_NAME, RecipeError, looks_like_token, wrong_kind
from nnx_surgery.model_inputs import position_limit
from nnx_surgery.surgery.modeling.generation import TextCodec
from nnx_surgery.export.gguf_export import resolve_export_dtype

UNKNOWN_POSITIONS = 1 << 16  # new tokens allowed when config.json states no max_position_embeddings


def prompt_text(prompt: str) -> str:
    """--prompt as text; bytes that are not UTF-8 (Python keeps them as lone surrogates) are refused."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RecipeError(f"--prompt: byte {error.start} is not valid UTF-8 text (the shell passed raw bytes); give "
                          "the prompt as UTF-8, e.g. convert it with iconv.") from None
    if not prompt:
        raise RecipeError("--prompt is empty; give the text to continue.")
    return prompt


def prompt_ids(args: argparse.Namespace, folder: str) -> list[int]:
    """The prompt's token ids (BOS first, as generate adds it), checked with --max-new-tokens against the
    model's positions (config.json's max_position_embeddings) before anything is allocated: a longer prompt is
    refused, or with --truncate-prompt cut from the left (BOS kept) with a line on stderr saying so."""

    codec = TextCodec.of(folder)
    ids = codec.encode(prompt_text(args.prompt))
    limit = position_limit(folder).get("max_positions") or UNKNOWN_POSITIONS
    where = f"max_position_embeddings {limit} in {folder}/config.json" if limit != UNKNOWN_POSITIONS else \
        f"{limit} (config.json states no max_position_embeddings)"
    if args.max_new_tokens >= limit:
        raise RecipeError(f"--max-new-tokens {args.max_new_tokens}: the model has {where} positions, which must "
                          "hold the prompt too; give fewer new tokens.")
    room = limit - args.max_new_tokens
    if len(ids) > room:
        if not args.truncate_prompt:
            raise RecipeError(f"--prompt: {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} exceed the "
                              f"model's {where} positions; shorten the prompt, lower --max-new-tokens, or pass "
                              "--truncate-prompt to keep only its last tokens.")
        head = ids[:1] if codec.add_bos and ids[:1] == [codec.bos_id] else []
        ids = head + ids[len(ids) - (room - len(head)):]
        print(f"note: --truncate-prompt kept the prompt's last {room - len(head)} tokens (of the model's {limit} "
              f"positions, {args.max_new_tokens} are for new tokens)", file=sys.stderr)
    return ids


def continue_prompt(args: argparse.Namespace) -> str:
    """Continue --prompt with the model in FOLDER and print the continuation (greedy unless
    --sample-temperature > 0)."""
    folder = model_folder(args.folder, "FOLDER")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise RecipeError(f"FOLDER {args.folder}: no tokenizer.json there; generate reads the prompt with the "
                          "model's own tokenizer (folders from prune, distill, compress and import-gguf have one).")
    ids = prompt_ids(args, folder)
    model = surgery.load_pretrained(folder, dtype=args.dtype)
    result = surgery.generate(model, [ids], max_new_tokens=args.max_new_tokens,
                              temperature=args.sample_temperature, top_k=args.sample_top_k, top_p=args.sample_top_p, seed=args.seed,
                              tokenizer=folder)
    print(result.texts[0])
    return result.texts[0]


def gguf_to_folder(args: argparse.Namespace) -> str:
    """Write the GGUF file as a Hugging Face folder at OUTPUT."""
    if not os.path.isfile(args.gguf):
        raise RecipeError(f"FILE.gguf {args.gguf}: {wrong_kind(args.gguf, 'file')}; give a .gguf file (llama.cpp's, "
                          "or export-gguf's).")
    out = empty_folder(args.output, "OUTPUT", args.overwrite, inputs=input_paths(args.gguf))
    folder = surgery.import_gguf(args.gguf, out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"{folder}: {shape_line(surgery.ModelConfig.from_file(folder))}, {args.dtype}")
    return folder


def folder_to_gguf(args: argparse.Namespace) -> str:
    """Write the Gemma in FOLDER as one GGUF file (its tokenizer included) for llama.cpp."""

    folder = model_folder(args.folder, "FOLDER")
    resolve_flag_value("--gguf-type", args.gguf_type, resolve_export_dtype)
    out = new_file(args.output, "OUTPUT.gguf", args.overwrite, inputs=input_paths(args.folder))
    path = export.export_gguf(folder, out, dtype=args.gguf_type)
    print(f"gguf: {path}  ({os.path.getsize(path) / 2**20:.1f} MiB, {args.gguf_type}; run it with llama.cpp)")
    return path


def token_from(variable: str | None) -> str | None:
    """The token in the environment variable --token-env names (None: huggingface_hub's own lookup). A value
    that looks like a token rather than a variable's name is refused without being shown."""
    if not variable:
        return None
    if looks_like_token(variable) or not VARIABLE_NAME.fullmatch(variable):
        raise RecipeError("--token-env: the value given looks like a token (or is not a variable name), so it is "
                          "not shown; put the token in an environment variable (e.g. export HUB_WRITE=...) and "
                          "pass its name: --token-env HUB_WRITE.")
    token = os.environ.get(variable)
    if not token:
        raise RecipeError(f"--token-env {variable}: that environment variable is not set or empty; put a write "
                          "token in it, or drop --token-env to use HF_TOKEN or `hf auth login`.")
    return token


def push(args: argparse.Namespace) -> str:
    """Upload FOLDER to REPO_ID. The token comes from the environment only (--token-env VAR, else HF_TOKEN or
    `hf auth login`'s file) and is never printed."""
    token = token_from(args.token_env)
    model_folder(args.folder, "FOLDER")  # its config.json and tokenizer.json readable, before the Hub is asked
    url = export.push_to_hub(args.folder, args.repo_id, private=not args.public, revision=args.branch,
                              token=token, commit_message=args.message)
    print(f"pushed {os.path.abspath(args.folder)} to {url}")
    return str(url)
