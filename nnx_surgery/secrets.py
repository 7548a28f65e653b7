"""Masking secrets in anything a command prints: --token-env's value and the values of variables whose name says
they hold a secret (HF_TOKEN, *TOKEN*, *SECRET*, *PASSWORD*, *API_KEY*) read `<secret>`, in one-line errors, in
tracebacks (`--debug` and a bug's alike) and in argparse's refusals. Imports nothing heavy: the parser uses it."""
from __future__ import annotations

import os
import re

SECRET_VARIABLES = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY", re.IGNORECASE)
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def looks_like_token(text: str) -> bool:
    """A Hub token (hf_..., api_org_...) or anything long and random enough to be a secret, not a name."""
    if text.startswith(("hf_", "api_")):
        return True
    kinds = sum(any(test(c) for c in text) for test in (str.islower, str.isupper, str.isdigit))
    return len(text) >= 24 and kinds == 3


def secrets_of(argv: list[str]) -> list[str]:
    """The secrets a message could echo: the environment's secret values and a token given to --token-env."""
    secrets = [value for name, value in os.environ.items()  # a path or a sentence in such a variable is no secret
               if SECRET_VARIABLES.search(name) and len(value) >= 8 and not any(c in value for c in "/ \t")]
    for index, arg in enumerate(argv):
        given = argv[index + 1] if arg == "--token-env" and index + 1 < len(argv) else \
            arg.partition("=")[2] if arg.startswith("--token-env=") else None
        if given and (looks_like_token(given) or not VARIABLE_NAME.fullmatch(given)):
            secrets.append(given)
    return secrets


def redact(text: str, argv: list[str]) -> str:
    """`text` with every secret it could echo masked (`secrets_of`), longest first."""
    for secret in sorted(set(secrets_of(argv)), key=len, reverse=True):
        text = text.replace(secret, "<secret>")
    return text


__all__ = ["redact", "looks_like_token", "secrets_of", "SECRET_VARIABLES", "VARIABLE_NAME"]
