"""A small Hugging Face Hub stand-in for tests: stdlib HTTP server, in-memory repos, on 127.0.0.1.

It speaks the part of the Hub protocol the real `huggingface_hub` client (2.x, with HF_HUB_DISABLE_XET=1) and
`transformers.from_pretrained` use to publish and fetch a model repo:

    GET  /api/whoami-v2                                   Bearer token -> user and orgs
    POST /api/repos/create                                 private/public, 409 if it exists, 403 outside own namespaces
    POST /api/validate-yaml                                README front matter checks
    POST /api/models/{repo}/preupload/{rev}                regular vs LFS upload mode
    POST /{repo}.git/info/lfs/objects/batch                LFS batch, then PUT to the signed href it returns
    POST /api/models/{repo}/commit/{rev}                   NDJSON commit (file, lfsFile, deletedFile, deletedFolder)
    POST /api/models/{repo}/branch/{branch}                create a branch
    GET  /api/models/{repo}[/revision/{rev}], /refs, /tree/{rev}[/{path}]
    HEAD|GET /{repo}/resolve/{rev}/{path}                 X-Repo-Commit, ETag, X-Linked-Etag/Size, Range

Errors carry the `X-Error-Code` header the client maps to its exception types (RepoNotFound, RevisionNotFound,
EntryNotFound). Every request is logged (method, path, whether it was authenticated) so tests can count them.
The server stops when its `with` block ends, or on its own after `lifetime_s`.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

MAX_BODY = 256 << 20
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".npy", ".npz", ".h5", ".msgpack", ".model", ".gguf")
PIPELINE_TAGS = {"text-generation", "text2text-generation", "fill-mask", "feature-extraction", "text-classification"}
LICENSES = {"apache-2.0", "mit", "gemma", "cc-by-4.0", "cc-by-sa-4.0", "bsd-3-clause", "llama3", "other", "openrail"}
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


class HubReply(Exception):
    """Raised inside a handler to answer with an HTTP error."""

    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


@dataclass
class Blob:
    size: int
    content: bytes | None = None  # regular file
    sha256: str | None = None  # LFS file (content in FakeHub.lfs)

    @property
    def git_oid(self) -> str:
        data = self.content if self.sha256 is None else self.pointer()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # commit oid -> tree
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid

    def commit_of(self, revision: str) -> str:
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.commits:
            return revision
        raise HubReply(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class FakeHub:
    """`with FakeHub({"tok": ("alice", ["acme"])}) as hub: ... hub.url ...`; tokens map to (user, orgs[, role]).

    `role` ("write" or "read") is the token's; an org given as "acme:read" is one the user may only read."""

    def __init__(self, tokens: dict[str, tuple], *, lifetime_s: float = 600.0):
        self.tokens = {}
        for token, spec in tokens.items():  # orgs as "name" (write member) or "name:read" (read-only member)
            orgs = dict((org.split(":") + ["write"])[:2] for org in spec[1])
            self.tokens[token] = (spec[0], orgs, spec[2] if len(spec) > 2 else "write")
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, bool]] = []
        self.unhandled: list[str] = []
        self.faults: list[list] = []  # [method, path regex, status or "drop", times left]
        self.lock = threading.RLock()
        self.secret = hashlib.sha256(str(time.time_ns()).encode()).digest()
        self.lifetime_s = lifetime_s
        self._counter = itertools.count()
        self._server: ThreadingHTTPServer | None = None

    # -------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(RequestHandler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        self._timer = threading.Timer(self.lifetime_s, self.close)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            self._timer.cancel()
            server.shutdown()
            server.server_close()

    # -------------------------------------------------------------------------------------------- faults
    def fail(self, method: str, path: str, answer: int | str, times: int = 1) -> None:
        """Answer the next `times` requests `method` on a path matching regex `path` with HTTP status `answer`,
        or with "drop": the connection is closed without an answer (a dropped connection)."""
        with self.lock:
            self.faults.append([method, re.compile(path), answer, times])

    def fault_for(self, method: str, path: str) -> int | str | None:
        with self.lock:
            for fault in self.faults:
                if fault[0] == method and fault[1].search(path) and fault[3] > 0:
                    fault[3] -= 1
                    return fault[2]
        return None

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    # -------------------------------------------------------------------------------------------- model
    def user_of(self, headers) -> tuple | None:
        auth = headers.get("Authorization", "")
        if not auth:
            return None
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        if token not in self.tokens:
            raise HubReply(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def repo(self, repo_id: str, user, *, write: bool = False) -> Repo:
        repo = self.repos.get(repo_id)
        namespace = repo_id.split("/")[0]
        member = user is not None and (namespace == user[0] or namespace in user[1])
        if repo is None or (repo.private and not member):
            status = 401 if user is None else 404
            raise HubReply(status, "Repository not found", "RepoNotFound")
        if write and not self.can_write(user, namespace):
            raise HubReply(403, f"You don't have the rights to write to {repo_id}")
        return repo

    @staticmethod
    def can_write(user, namespace: str) -> bool:
        name, orgs, role = user
        return role == "write" and (namespace == name or orgs.get(namespace) == "write")

    def new_commit(self, repo: Repo, parent: str | None, tree: dict[str, Blob], message: str) -> str:
        seed = json.dumps([parent, sorted((p, b.git_oid) for p, b in tree.items()), message, next(self._counter)])
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = tree
        return oid

    def sign(self, oid: str) -> str:
        return hmac.new(self.secret, oid.encode(), hashlib.sha256).hexdigest()

    def file_content(self, blob: Blob) -> bytes:
        return blob.content if blob.sha256 is None else self.lfs[blob.sha256]


class RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections end on their own
    hub: FakeHub

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_HEAD(self):
        self.dispatch("HEAD")

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    # -------------------------------------------------------------------------------------------- plumbing
    def dispatch(self, method: str) -> None:
        hub = self.hub
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parse_qs(parts.query)
        hub.requests.append((method, path, bool(self.headers.get("Authorization"))))
        try:
            body = self.read_body()
            fault = hub.fault_for(method, path)
            if fault == "drop":
                self.close_connection = True
                return
            if fault is not None:
                raise HubReply(int(fault), f"injected failure {fault}")
            with hub.lock:
                status, headers, payload = self.route(method, path, query, body)
        except HubReply as reply:
            headers = {"X-Error-Message": reply.message}
            if reply.code:
                headers["X-Error-Code"] = reply.code
            status, payload = reply.status, {"error": reply.message, **reply.extra}
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY:
                    raise HubReply(413, "request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise HubReply(413, "request body too large")
        return self.rfile.read(length) if length else b""

    def route(self, method: str, path: str, query: dict, body: bytes):
        hub, user = self.hub, self.hub.user_of(self.headers)
        segments = path.strip("/").split("/")
        if path.startswith("/__control/") and method == "POST":  # tests steer the hub from a client process
            return self.control(segments[1], json.loads(body or b"{}"))
        if path == "/api/whoami-v2" and method == "GET":
            return self.whoami(user)
        if path == "/api/repos/create" and method == "POST":
            return self.create_repo(user, json.loads(body or b"{}"))
        if path == "/api/agent-harnesses" and method == "GET":  # the client's agent-detection registry
            return 200, {}, {"standardEnvVars": [], "harnesses": {}}
        if path == "/api/validate-yaml" and method == "POST":
            return self.validate_yaml(json.loads(body or b"{}"))
        if path.startswith("/__lfs/") and method == "PUT":
            return self.lfs_put(segments[1], query, body)
        if segments[0] == "api" and len(segments) >= 4 and segments[1] == "models":
            repo_id, rest = "/".join(segments[2:4]), segments[4:]
            if not rest and method == "GET":
                return self.model_info(hub.repo(repo_id, user), "main")
            if rest[0] == "revision" and len(rest) == 2 and method == "GET":
                return self.model_info(hub.repo(repo_id, user), rest[1])
            if rest == ["refs"] and method == "GET":
                repo = hub.repo(repo_id, user)
                return 200, {}, {"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c}
                                              for b, c in repo.branches.items()], "tags": [], "converts": []}
            if rest[0] == "tree" and len(rest) >= 2 and method == "GET":
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                return self.tree(hub.repo(repo_id, user), rest[1], "/".join(rest[2:]), recursive)
            if rest[0] == "preupload" and len(rest) == 2 and method == "POST":
                return self.preupload(hub.repo(repo_id, user, write=True), rest[1], json.loads(body))
            if rest[0] == "commit" and len(rest) == 2 and method == "POST":
                return self.commit(hub.repo(repo_id, user, write=True), rest[1], body)
            if rest[0] == "branch" and len(rest) == 2 and method == "POST":
                return self.create_branch(hub.repo(repo_id, user, write=True), rest[1], json.loads(body or b"{}"))
        if path.endswith(".git/info/lfs/objects/batch") and method == "POST":
            repo_id = path[1:-len(".git/info/lfs/objects/batch")]
            return self.lfs_batch(hub.repo(repo_id, user, write=True), json.loads(body))
        if len(segments) >= 5 and segments[2] == "resolve" and method in ("GET", "HEAD"):
            repo = hub.repo("/".join(segments[:2]), user)
            return self.resolve(repo, segments[3], "/".join(segments[4:]))
        hub.unhandled.append(f"{method} {path}")
        raise HubReply(404, f"fake hub does not serve {method} {path}")

    # -------------------------------------------------------------------------------------------- endpoints
    def control(self, action: str, payload: dict):
        """fail {method, path, answer, times} | clear | count {method, path}: requests so far that match."""
        if action == "fail":
            self.hub.fail(payload["method"], payload["path"], payload["answer"], payload.get("times", 1))
        elif action == "clear":
            self.hub.clear_faults()
        elif action == "count":
            pattern = re.compile(payload["path"])
            return 200, {}, {"count": sum(1 for m, p, _ in self.hub.requests
                                          if m == payload["method"] and pattern.search(p))}
        else:
            raise HubReply(404, f"no control action {action!r}")
        return 200, {}, {}

    def whoami(self, user):
        if user is None:
            raise HubReply(401, "Authorization header is required")
        name, orgs, role = user
        return 200, {}, {"type": "user", "name": name, "fullname": name,
                         "orgs": [{"type": "org", "name": org, "roleInOrg": r} for org, r in orgs.items()],
                         "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": role}}}

    def create_repo(self, user, payload: dict):
        if user is None:
            raise HubReply(401, "You must be authenticated to create a repo")
        if payload.get("type") not in (None, "model"):
            raise HubReply(400, "fake hub only hosts model repos")
        namespace = payload.get("organization") or user[0]
        repo_id = f"{namespace}/{payload.get('name')}"
        if not REPO_ID.match(repo_id):
            raise HubReply(400, f"invalid repo name {repo_id!r}")
        if not self.hub.can_write(user, namespace):
            raise HubReply(403, f"You don't have the rights to create a model under the namespace \"{namespace}\"")
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            raise HubReply(409, "You already created this model repo", url=url)  # the client reads "url"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = self.hub.repos[repo_id] = Repo(repo_id, private)
        tree = {".gitattributes": Blob(len(GITATTRIBUTES), content=GITATTRIBUTES)}
        repo.branches["main"] = self.hub.new_commit(repo, None, tree, "initial commit")
        return 200, {}, {"url": url, "name": repo_id, "id": repo_id}

    def validate_yaml(self, payload: dict):
        content = payload.get("content", "")
        errors = []
        match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
        if not match:
            return 200, {}, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as err:
            meta, errors = None, [{"message": f"YAML parse error: {err}"}]
        if meta is not None and not isinstance(meta, dict):
            errors.append({"message": "metadata must be a YAML mapping"})
        meta = meta if isinstance(meta, dict) else {}
        if "license" in meta and meta["license"] not in LICENSES:
            errors.append({"message": f'"license" must be one of the Hub licenses, got {meta["license"]!r}'})
        if "pipeline_tag" in meta and meta["pipeline_tag"] not in PIPELINE_TAGS:
            errors.append({"message": f'"pipeline_tag" {meta["pipeline_tag"]!r} is not a known task'})
        if "tags" in meta and not (isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])):
            errors.append({"message": '"tags" must be a list of strings'})
        if "library_name" in meta and not isinstance(meta["library_name"], str):
            errors.append({"message": '"library_name" must be a string'})
        bases = meta.get("base_model", [])
        for base in [bases] if isinstance(bases, str) else bases if isinstance(bases, list) else [None]:
            if not (isinstance(base, str) and REPO_ID.match(base)):
                errors.append({"message": f'"base_model" must be Hub model ids, got {base!r}'})
        return (400 if errors else 200), {}, {"errors": errors, "warnings": []}

    def preupload(self, repo: Repo, revision: str, payload: dict):
        tree = repo.commits[repo.commit_of(revision)]
        files = []
        for item in payload["files"]:
            sample = base64.b64decode(item.get("sample", ""))
            lfs = item["path"].endswith(LFS_SUFFIXES) or b"\0" in sample or item["size"] > (10 << 20)
            existing = tree.get(item["path"])
            oid = None if existing is None else (existing.sha256 or existing.git_oid)
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": oid})
        return 200, {}, {"files": files, "commitOid": repo.commit_of(revision)}

    def lfs_batch(self, repo: Repo, payload: dict):
        objects = []
        for obj in payload.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.lfs:
                href = f"{self.hub.url}/__lfs/{obj['oid']}?size={obj['size']}&sig={self.hub.sign(obj['oid'])}"
                entry["actions"] = {"upload": {"href": href, "header": {}}}
            objects.append(entry)
        return 200, {"Content-Type": "application/vnd.git-lfs+json"}, {"transfer": "basic", "objects": objects}

    def lfs_put(self, oid: str, query: dict, body: bytes):
        if not hmac.compare_digest(query.get("sig", [""])[0], self.hub.sign(oid)):
            raise HubReply(403, "invalid upload signature")
        if hashlib.sha256(body).hexdigest() != oid or len(body) != int(query.get("size", ["-1"])[0]):
            raise HubReply(400, "uploaded content does not match its oid/size")
        self.hub.lfs[oid] = body
        return 200, {}, b""

    def commit(self, repo: Repo, revision: str, body: bytes):
        if revision not in repo.branches:
            raise HubReply(404, f"Invalid rev id: {revision} (commits go to an existing branch)", "RevisionNotFound")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubReply(400, "commit payload must start with a header line")
        header, head = lines[0]["value"], repo.branches[revision]
        if header.get("parentCommit") not in (None, head):
            raise HubReply(412, "A commit has happened since. Please refresh and try again.")
        tree = dict(repo.commits[head])
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                content = base64.b64decode(value["content"])
                tree[value["path"]] = Blob(len(content), content=content)
            elif key == "lfsFile":
                if value["oid"] not in self.hub.lfs:
                    raise HubReply(422, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                tree[value["path"]] = Blob(len(self.hub.lfs[value["oid"]]), sha256=value["oid"])
            elif key == "deletedFile":
                if tree.pop(value["path"], None) is None:
                    raise HubReply(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                tree = {p: b for p, b in tree.items() if not p.startswith(prefix)}
            else:
                raise HubReply(400, f"unknown commit operation {key!r}")
        oid = self.hub.new_commit(repo, head, tree, header.get("summary", ""))
        repo.branches[revision] = oid
        return 200, {}, {"success": True, "commitOid": oid, "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{oid}"}

    def create_branch(self, repo: Repo, branch: str, payload: dict):
        if branch in repo.branches:
            raise HubReply(409, f"Branch {branch} already exists")
        repo.branches[branch] = repo.commit_of(payload.get("startingPoint") or "main")
        return 200, {}, {}

    def model_info(self, repo: Repo, revision: str):
        oid = repo.commit_of(revision)
        return 200, {}, {"id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                         "sha": oid, "private": repo.private, "gated": False, "disabled": False, "tags": [],
                         "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                         "siblings": [{"rfilename": p} for p in sorted(repo.commits[oid])]}

    def tree(self, repo: Repo, revision: str, folder: str, recursive: bool):
        files = repo.commits[repo.commit_of(revision)]
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(prefix + "/".join(parts[:i + 1]) for i in range(len(parts)))
            blob = files[path]
            entry = {"type": "file", "path": path, "size": blob.size, "oid": blob.git_oid}
            if blob.sha256:
                entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(blob.pointer())}
            entries.append(entry)
        if prefix and not entries and not folders:
            raise HubReply(404, f"{folder} does not exist at {revision}", "EntryNotFound")
        dirs = [{"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()} for p in sorted(folders)]
        return 200, {}, dirs + entries

    def resolve(self, repo: Repo, revision: str, path: str):
        oid = repo.commit_of(revision)
        blob = repo.commits[oid].get(path)
        if blob is None:
            raise HubReply(404, f"Entry not found: {path}", "EntryNotFound")
        content = self.hub.file_content(blob)
        headers = {"X-Repo-Commit": oid, "ETag": f'"{blob.sha256 or blob.git_oid}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if blob.sha256:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": blob.size})
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if match and match.group(1):
            start = int(match.group(1))
            end = min(int(match.group(2)) if match.group(2) else len(content) - 1, len(content) - 1)
            if start >= len(content):
                headers["Content-Range"] = f"bytes */{len(content)}"
                return 416, headers, b""
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            return 206, headers, content[start:end + 1]
        return 200, headers, content
