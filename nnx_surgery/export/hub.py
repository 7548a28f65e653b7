"""Publish a student folder (written by `save_pretrained`) to the Hugging Face Hub.

`push_to_hub` checks everything it can before the first upload: the folder is a complete HF model folder, a
token exists, the Hub is reachable, the token's user may write to the repo's namespace (`whoami` name and
orgs), and a repo that already exists is private when `private=True`. Any failure is raised as `HubError`
with a message that says what to do, never containing the token.

Uses `HfApi.create_repo(exist_ok=True)`, `create_branch` (a branch must exist before uploading to it) and
`upload_folder` (with hf_xet installed it streams and resumes; huggingface_hub 2.x has no `upload_large_folder`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Iterator

from nnx_surgery.surgery.storage.safetensors_stream import CheckpointError, confined_path

# huggingface_hub is imported inside the functions that use it: it reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE...
# once, when first imported, so `import surgery` must not import it before the caller has set them.

logger = logging.getLogger(__name__)

# Local leftovers that must never reach the Hub: our atomic-write temporaries and hidden files.
IGNORE_PATTERNS = [".*", "*.tmp-*", "*.partial-*", "*.old-*", "__pycache__/*"]
# Weight files already on the branch that the folder does not have are deleted in the same commit: a branch
# that kept main's `model.safetensors` next to a new sharded index would load the stale file.
STALE_WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json"]
INDEX_FILE = "model.safetensors.index.json"


class HubError(RuntimeError):
    """Publishing failed; the message says why and how to fix it. `status_code` is the HTTP status, if any."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


def check_model_folder(folder: str | os.PathLike) -> list[str]:
    """The files of a complete HF model folder (config.json + all safetensors it references), or `HubError`."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise HubError(f"{folder!r} is not a folder; pass the folder written by surgery.save_pretrained.")
    files = sorted(os.listdir(folder))
    config_path = os.path.join(folder, "config.json")
    if "config.json" not in files:
        raise HubError(f"{folder} has no config.json, so it is not a Hugging Face model folder; write it with "
                       "surgery.save_pretrained(model, folder) first.")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise HubError(f"{config_path} is not valid JSON ({err}); rewrite the folder with save_pretrained.") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise HubError(f"{config_path} has no model_type; it is not a transformers model config.")
    shards = [name for name in files if name.endswith(".safetensors")]
    if not shards:
        raise HubError(f"{folder} has config.json but no .safetensors weights; save the model with "
                       "surgery.save_pretrained (pickled .bin checkpoints are not published).")
    if INDEX_FILE in files:
        index_path = os.path.join(folder, INDEX_FILE)
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise HubError(f"{index_path} is not a valid safetensors index ({type(err).__name__}); save the folder "
                           "again.") from None
        for name in names:
            try:
                confined_path(folder, name, f"{index_path}: weight_map")
            except CheckpointError as err:
                raise HubError(str(err)) from None
        missing = sorted(set(names) - set(shards))
        if missing:
            raise HubError(f"{folder}: {INDEX_FILE} references {missing[:3]}, which are missing; the folder is "
                           "incomplete (interrupted save?). Save it again.")
    elif shards != ["model.safetensors"]:
        raise HubError(f"{folder} has shards {shards[:3]} but no {INDEX_FILE}; transformers cannot load it.")
    return files


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = True, revision: str | None = None,
                token: str | None = None, commit_message: str | None = None,
                endpoint: str | None = None) -> str:
    """Upload a model folder to `repo_id` (created private by default) on branch `revision` (default main).

    `repo_id` without a namespace goes to the token's user. The token comes from `token=`, HF_TOKEN or the file
    written by `hf auth login`. Returns the commit URL; it is a huggingface_hub `CommitInfo` (a `str`) whose
    `.oid` is the commit hash, usable as `revision=` when loading. Weight files on the branch that the folder
    lacks (e.g. an old single `model.safetensors` when the folder is sharded) are deleted in the same commit.
    """
    folder = os.path.abspath(os.fspath(folder))
    check_model_folder(folder)
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        raise HubError("cannot push: offline mode is on (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1). Unset it "
                       f"and push again; the folder {folder} is complete and can be uploaded later.")
    token = _token(token)
    api = HfApi(endpoint=endpoint, token=token)
    where = endpoint or constants.ENDPOINT
    with _translated_errors(token, where, repo_id):
        repo_id = _writable_repo(api, repo_id)
        _retrying(lambda: api.create_repo(repo_id, private=private, exist_ok=True), "create_repo")
        if private and _retrying(lambda: api.model_info(repo_id), "model_info").private is False:
            # create_repo ignores `private` for a repo that already exists
            raise HubError(f"{repo_id} already exists and is public, but private=True was asked for; make the "
                           "repo private on the Hub, or pass private=False to publish there.")
        if revision and revision != constants.DEFAULT_REVISION:
            _retrying(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), "create_branch")
        logger.info("uploading %s to %s (revision %s, private=%s)", folder, repo_id, revision or "main", private)
        # Each request of the upload is retried by huggingface_hub itself (http_backoff: 408, 429, 5xx and dropped
        # connections, 1 s doubling to 8 s, 5 retries). Re-running an interrupted push uploads only what the Hub
        # lacks: LFS files it already has are skipped by the LFS batch answer.
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                   commit_message=commit_message or f"Upload {os.path.basename(folder)} "
                                                                    "(nnx-surgery student)",
                                   ignore_patterns=list(IGNORE_PATTERNS),
                                   delete_patterns=list(STALE_WEIGHT_PATTERNS))
    logger.info("pushed %s to %s", folder, commit)
    return commit


def check_push_access(repo_id: str, *, token: str | None = None, endpoint: str | None = None) -> str:
    """What `push_to_hub` checks before uploading, without a folder and without creating anything: not offline,
    a token, the Hub reachable and the token allowed to write to `repo_id`'s namespace. Returns the full repo id;
    a HubError (the token never in it) otherwise. For a run that pushes at its end, to refuse at its start."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        raise HubError(f"cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1); "
                       "unset it, or publish the folder later with `nnx-surgery push`.")
    token = _token(token)
    where = endpoint or constants.ENDPOINT
    with _translated_errors(token, where, repo_id):
        return _writable_repo(HfApi(endpoint=endpoint, token=token), repo_id)


def _token(token: str | None) -> str:
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubError("cannot push: no Hugging Face token. Set HF_TOKEN, run `hf auth login`, or name the variable "
                       "holding one (`nnx-surgery push --token-env VAR`; in Python, push_to_hub(token=...)); it needs "
                       "write access (https://huggingface.co/settings/tokens).")
    return token


def _writable_repo(api, repo_id: str) -> str:
    """`repo_id` with the token's user as namespace when it has none, refused when the token cannot write there."""
    identity = _retrying(api.whoami, "whoami")
    user = identity.get("name")
    orgs = [org.get("name") for org in identity.get("orgs", [])]
    if "/" not in repo_id:
        repo_id = f"{user}/{repo_id}"
    namespace = repo_id.split("/")[0]
    if namespace not in {user, *orgs}:
        raise HubError(f"cannot push to {repo_id}: the token belongs to user {user!r} (orgs: "
                       f"{', '.join(orgs) or 'none'}), who cannot write to namespace {namespace!r}. Use "
                       f"'{user}/{repo_id.split('/', 1)[1]}' or a token of a member of {namespace!r}.",
                       status_code=403)
    role = identity.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        raise HubError(f"cannot push to {repo_id}: the token is read-only; create a token with write access.",
                       status_code=403)
    return repo_id


RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # what huggingface_hub's own http_backoff retries
RETRIES, RETRY_WAIT_S, RETRY_MAX_WAIT_S = 5, 1.0, 8.0


def _retrying(call, what: str):
    """`call()` with huggingface_hub's backoff policy, for the API calls that do not go through its
    `http_backoff` (whoami, create_repo, model_info, create_branch): transient answers (RETRY_STATUS) and dropped
    connections are retried RETRIES times, waiting RETRY_WAIT_S doubling up to RETRY_MAX_WAIT_S."""
    from huggingface_hub.errors import HfHubHTTPError

    wait = RETRY_WAIT_S
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status not in RETRY_STATUS or attempt == RETRIES:
                raise
            reason = f"HTTP {status}"
        except _transport_errors() as err:
            if attempt == RETRIES:
                raise
            reason = type(err).__name__
        logger.warning("%s: %s; retrying in %.1f s (retry %d of %d)", what, reason, wait, attempt + 1, RETRIES)
        time.sleep(wait)
        wait = min(RETRY_MAX_WAIT_S, wait * 2)


def _transport_errors() -> tuple[type, ...]:
    errors: list[type] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        with contextlib.suppress(ImportError):
            mod = __import__(module)
            errors.append(getattr(mod, "TransportError", None) or getattr(mod, "ConnectionError"))
    return tuple(errors)


@contextlib.contextmanager
def _translated_errors(token: str, endpoint: str, repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub/httpx errors into `HubError`s whose text never contains the token."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    def scrub(text: str) -> str:
        return text.replace(token, "<token>") if token else text

    try:
        yield
    except HubError as err:
        raise HubError(scrub(str(err)), err.status_code) from None
    except OfflineModeIsEnabled:
        raise HubError("cannot push: offline mode is on (HF_HUB_OFFLINE=1); unset it and push again.") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        detail = scrub(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        server = scrub(getattr(err, "server_message", None) or "")
        if status == 401:
            message = (f"the Hub at {endpoint} rejected the token (401 {server or detail}); it is invalid or "
                       "expired: set a valid HF_TOKEN or run `hf auth login --force`.")
        elif status == 403:
            message = (f"no write access to {repo_id} (403: {server or detail}); the repo belongs to someone else "
                       "or the token lacks write permission. Push to your own namespace or ask for access.")
        elif status == 404:
            message = (f"the Hub at {endpoint} answered 404 (not found: {server or detail}) while pushing to "
                       f"{repo_id}; check the repo id, the revision and HF_ENDPOINT, and that the token can see "
                       "the repo.")
        elif status is not None and status >= 500 or status in RETRY_STATUS:
            message = (f"the Hub at {endpoint} failed while pushing to {repo_id} (HTTP {status}: "
                       f"{server or detail}), also after {RETRIES} retries; it is having trouble: push again "
                       "later (files already uploaded are not uploaded again).")
        else:
            message = f"pushing to {repo_id} failed: HTTP {status}: {server or detail}"
        raise HubError(message, status_code=status) from None
    except ValueError as err:  # e.g. README.md metadata rejected by /api/validate-yaml
        raise HubError(f"pushing to {repo_id} failed: {scrub(str(err))}") from None
    except _transport_errors() as err:
        raise HubError(f"cannot reach the Hub at {endpoint}, or it dropped the connection ({type(err).__name__}: "
                       f"{scrub(str(err))}), also after {RETRIES} retries; check the network, a proxy or "
                       "HF_ENDPOINT, and push again (files already uploaded are not uploaded again).") from None
    except Exception as err:  # anything else (e.g. from hf_xet): same message, token scrubbed, no chained repr
        raise HubError(f"pushing to {repo_id} failed: {type(err).__name__}: {scrub(str(err))}") from None
