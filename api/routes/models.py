"""Base-model files for clients: tokenizers, so that no client needs the Hugging Face hub."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from pydantic import BaseModel

from api.deps import CurrentPrincipal, State
from api.openapi import FILE_RESPONSE, error_responses
from core.errors import NotFound
from scheduler.served import tokenizer_key

router = APIRouter(prefix="/api/v1", tags=["models"])


class TokenizerFilesResponse(BaseModel):
    model: str
    files: list[str]


def _folder(state: State, model: str) -> Path:
    served = state.settings.model_aliases.get(model, model)
    if model not in state.settings.offered_models:
        raise NotFound(
            f"base model {model!r} is not served here; use one of {state.settings.offered_models}"
        )
    try:
        return state.store.open_dir(state.store.uri(tokenizer_key(served)))
    except FileNotFoundError as exc:
        raise NotFound(
            f"the tokenizer of {model!r} is not published yet; retry once a worker serving it "
            "has started"
        ) from exc


@router.get(
    "/models/{model:path}/tokenizer",
    response_model=TokenizerFilesResponse,
    responses=error_responses(401, 403, 404),
)
def tokenizer_files(model: str, _: CurrentPrincipal, state: State) -> TokenizerFilesResponse:
    """The tokenizer's file names; fetch each from `/models/{model}/tokenizer/{file}`."""
    folder = _folder(state, model)
    return TokenizerFilesResponse(
        model=model, files=sorted(p.name for p in folder.iterdir() if p.is_file())
    )


@router.get(
    "/models/{model:path}/tokenizer/{filename}",
    response_model=None,
    response_class=FileResponse,
    responses=FILE_RESPONSE | error_responses(401, 403, 404),
)
def tokenizer_file(model: str, filename: str, _: CurrentPrincipal, state: State) -> FileResponse:
    folder = _folder(state, model)
    path = folder / filename
    if "/" in filename or not path.is_file():
        raise NotFound(
            f"{filename!r} is not a tokenizer file of {model!r}; list them at /models/{model}/tokenizer"
        )
    return FileResponse(path)
