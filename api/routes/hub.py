"""A read-only Hugging Face hub endpoint for the served models' tokenizers.

With `HF_ENDPOINT=<server>/hf`, `huggingface_hub` (and so `transformers.AutoTokenizer` and the
tinker SDK's `get_tokenizer()`) downloads a served model's tokenizer files from this server: the
hub's `resolve` route, answered with the headers `huggingface_hub` reads (`X-Repo-Commit`,
`ETag`, `Content-Length`) and its `X-Error-Code` on a 404, and the metadata routes
`transformers` asks before it (`model_info`, `list_repo_files`, `list_repo_tree`). Each served
model and alias is a repo with one revision, 'main', whose commit id is a hash of its files.
Like the hub's public models, it asks for no key: tokenizers are not secret. It is read-only.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

from api.deps import State
from api.openapi import error_responses
from core.errors import ErrorCode
from scheduler.served import tokenizer_key

router = APIRouter(prefix="/hf", tags=["hub"])

# The hub's client tells its 404s apart by `X-Error-Code`; the body is Treadle's error body.
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: error_responses(404)[404]
    | {
        "description": "No such served model (`X-Error-Code: RepoNotFound`), revision "
        "(`RevisionNotFound`) or file (`EntryNotFound`).",
        "headers": {
            "X-Error-Code": {
                "description": "RepoNotFound, RevisionNotFound or EntryNotFound",
                "schema": {"type": "string"},
            }
        },
    }
}
_FILE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes, with `X-Repo-Commit`, `ETag` and `Content-Length`.",
        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
    }
}

_HEAD_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "The headers of the GET answer, without the body."}
}


class _HubError(Exception):
    def __init__(self, code: str, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.commit = commit

    def response(self) -> JSONResponse:
        # The message stays out of the headers: it quotes the request, which may be any text.
        headers = {"X-Error-Code": self.code}
        if self.commit is not None:
            headers["X-Repo-Commit"] = self.commit
        return JSONResponse(
            {
                "detail": self.message,
                "category": "user",
                "code": ErrorCode.NOT_FOUND.value,
                "error": self.message,
            },
            status_code=404,
            headers=headers,
        )


def _files(state: State, repo_id: str) -> dict[str, Path]:
    if repo_id not in state.settings.offered_models:
        raise _HubError(
            "RepoNotFound",
            f"{repo_id!r} is not served here; use one of {state.settings.offered_models}",
        )
    served = state.settings.model_aliases.get(repo_id, repo_id)
    try:
        folder = state.store.open_dir(state.store.uri(tokenizer_key(served)))
    except FileNotFoundError as exc:
        raise _HubError(
            "RepoNotFound",
            f"the tokenizer of {repo_id!r} is not published yet; retry once a worker serving it "
            "has started",
        ) from exc
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _digest(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    """A file's sha256, computed once per version of the file (keyed by its modification time
    and size too): every request names every file's digest, so reading them all each time
    would cost a tokenizer's megabytes per request."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _commit(files: dict[str, Path]) -> str:
    """A 40-hex revision id that changes whenever a file does, as a git commit id would."""
    digest = hashlib.sha1(usedforsecurity=False)
    for name, path in files.items():
        digest.update(f"{name}\0{_sha256(path)}\0".encode())
    return digest.hexdigest()


def _at(state: State, repo_id: str, revision: str) -> tuple[dict[str, Path], str]:
    """The repo's files and commit id, if `revision` names it ('main' or the commit id)."""
    files = _files(state, repo_id)
    commit = _commit(files)
    if revision not in ("main", commit):
        raise _HubError(
            "RevisionNotFound",
            f"{repo_id!r} has the revisions 'main' and {commit!r}, not {revision!r}",
            commit,
        )
    return files, commit


def _info(state: State, repo_id: str, revision: str) -> JSONResponse:
    try:
        files, commit = _at(state, repo_id, revision)
    except _HubError as error:
        return error.response()
    siblings = [
        {"rfilename": name, "size": path.stat().st_size, "blobId": _sha256(path)}
        for name, path in files.items()
    ]
    body = {
        "id": repo_id,
        "modelId": repo_id,
        "sha": commit,
        "private": False,
        "gated": False,
        "disabled": False,
        "tags": [],
        "siblings": siblings,
    }
    return JSONResponse(body, headers={"X-Repo-Commit": commit})


def _tree(state: State, repo_id: str, revision: str, folder: str) -> JSONResponse:
    try:
        files, commit = _at(state, repo_id, revision)
        if folder.strip("/"):
            raise _HubError(
                "EntryNotFound", f"{repo_id!r} has no folder {folder!r}; all files are at its top"
            )
    except _HubError as error:
        return error.response()
    entries = [
        {"type": "file", "path": name, "size": path.stat().st_size, "oid": _sha256(path)}
        for name, path in files.items()
    ]
    return JSONResponse(entries, headers={"X-Repo-Commit": commit})


_JSON_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "As the Hugging Face hub answers it, with the fields its client reads.",
        "content": {"application/json": {"schema": {}}},
    }
}


@router.get(
    "/api/models/{repo_id:path}/tree/{revision}",
    response_model=None,
    responses=_JSON_OK | _NOT_FOUND,
)
def tree(repo_id: str, revision: str, state: State) -> JSONResponse:
    """The repo's files (`list_repo_files`, `list_repo_tree`); they are all at its top."""
    return _tree(state, repo_id, revision, "")


@router.get(
    "/api/models/{repo_id:path}/tree/{revision}/{folder:path}",
    response_model=None,
    responses=_JSON_OK | _NOT_FOUND,
)
def tree_folder(repo_id: str, revision: str, folder: str, state: State) -> JSONResponse:
    """A folder of the repo: none exists, so only an empty one lists the files."""
    return _tree(state, repo_id, revision, folder)


@router.get(
    "/api/models/{repo_id:path}/revision/{revision}",
    response_model=None,
    responses=_JSON_OK | _NOT_FOUND,
)
def model_info_at(repo_id: str, revision: str, state: State) -> JSONResponse:
    """`model_info` at a revision: the commit id and the files."""
    return _info(state, repo_id, revision)


def _resolve(state: State, repo_id: str, revision: str, filename: str) -> FileResponse:
    files, commit = _at(state, repo_id, revision)
    path = files.get(filename)
    if path is None:
        raise _HubError(
            "EntryNotFound",
            f"{repo_id!r} has no file {filename!r}; its files are {sorted(files)}",
            commit,
        )
    etag = f'"{_sha256(path)}"'
    return FileResponse(path, headers={"X-Repo-Commit": commit, "ETag": etag})


@router.get(
    "/{repo_id:path}/resolve/{revision}/{filename}",
    response_model=None,
    response_class=FileResponse,
    responses=_FILE | _NOT_FOUND,
)
def resolve(repo_id: str, revision: str, filename: str, state: State) -> Response:
    """A file of a served model's tokenizer, as the Hugging Face hub serves a repo's files."""
    try:
        return _resolve(state, repo_id, revision, filename)
    except _HubError as error:
        return error.response()


@router.head(
    "/{repo_id:path}/resolve/{revision}/{filename}",
    response_model=None,
    response_class=Response,
    responses=_HEAD_OK | _NOT_FOUND,
)
def resolve_head(repo_id: str, revision: str, filename: str, state: State) -> Response:
    """The headers of `GET` on the same path: `huggingface_hub` reads them before downloading."""
    try:
        answer = _resolve(state, repo_id, revision, filename)
    except _HubError as error:
        failed = error.response()
        return Response(status_code=404, headers=dict(failed.headers))
    size = Path(answer.path).stat().st_size
    headers = {k: v for k, v in answer.headers.items() if k.lower() != "content-length"}
    return Response(status_code=200, headers=headers | {"Content-Length": str(size)})


@router.get("/api/models/{repo_id:path}", response_model=None, responses=_JSON_OK | _NOT_FOUND)
def model_info(repo_id: str, state: State) -> JSONResponse:
    """`model_info`: the commit id and the files at 'main'."""
    return _info(state, repo_id, "main")
