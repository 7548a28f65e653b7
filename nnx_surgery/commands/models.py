"""`nnx-surgery generate`, `import-gguf`, `export-gguf` and `push`: surgery.generate, surgery.import_gguf,
surgery.export_gguf and surgery.push_to_hub on a model folder."""
from __future__ import annotations

import argparse
import os

from nnx_surgery import surgery
from nnx_surgery.commands import checked, empty_folder, model_folder, new_file, shape_line
from nnx_surgery.recipes.cli import RecipeError


def generate(args: argparse.Namespace) -> str:
    """Continue --prompt with the model in FOLDER and print the continuation (greedy unless --temperature > 0)."""
    folder = model_folder(args.folder, "FOLDER")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise RecipeError(f"FOLDER {args.folder}: no tokenizer.json there; generate reads the prompt with the "
                          "model's own tokenizer (folders from prune, distill, compress and import-gguf have one).")
    if not args.prompt:
        raise RecipeError("--prompt is empty; give the text to continue.")
    model = surgery.load_pretrained(folder, dtype=args.dtype)
    result = surgery.generate(model, [args.prompt], max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              tokenizer=folder)
    print(result.texts[0])
    return result.texts[0]


def import_gguf(args: argparse.Namespace) -> str:
    """Write the GGUF file as a Hugging Face folder at OUTPUT."""
    if not os.path.isfile(args.gguf):
        raise RecipeError(f"FILE.gguf {args.gguf}: no such file; give a .gguf file (llama.cpp's, or export-gguf's).")
    out = empty_folder(args.output, "OUTPUT", overwrite=False)
    folder = surgery.import_gguf(args.gguf, out, dtype=args.dtype)
    print(f"{folder}: {shape_line(surgery.ModelConfig.from_file(folder))}, {args.dtype}")
    return folder


def export_gguf(args: argparse.Namespace) -> str:
    """Write the Gemma in FOLDER as one GGUF file (its tokenizer included) for llama.cpp."""
    from nnx_surgery.surgery.gguf_export import resolve_export_dtype

    folder = model_folder(args.folder, "FOLDER")
    checked("--dtype", args.dtype, resolve_export_dtype)
    out = new_file(args.output, "OUTPUT.gguf", args.overwrite)
    path = surgery.export_gguf(folder, out, dtype=args.dtype)
    print(f"gguf: {path}  ({os.path.getsize(path) / 2**20:.1f} MiB, {args.dtype}; run it with llama.cpp)")
    return path


def push(args: argparse.Namespace) -> str:
    """Upload FOLDER to REPO_ID. The token comes from the environment only (--token-env VAR, else HF_TOKEN or
    `hf auth login`'s file) and is never printed."""
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise RecipeError(f"--token-env {args.token_env}: that environment variable is not set or empty; put "
                              "a write token in it, or drop --token-env to use HF_TOKEN or `hf auth login`.")
    url = surgery.push_to_hub(args.folder, args.repo_id, private=not args.public, revision=args.revision,
                              token=token, commit_message=args.message)
    print(f"pushed {os.path.abspath(args.folder)} to {url}")
    return str(url)
