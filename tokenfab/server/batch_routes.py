"""The Batch API's HTTP side: /v1/files and /v1/batches, as OpenAI defines them.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files, /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST /v1/batches {input_file_id, endpoint, completion_window: "24h", metadata}
    GET /v1/batches?limit=&after=   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

The work happens in tokenfab.batch (store, runner, service); this module parses and answers.
"""
from __future__ import annotations


from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.batch.lines import ENDPOINTS
from tokenfab.batch.service import BatchService
from tokenfab.batch.store import StoreError
from tokenfab.server.errors import APIError, parse_json_object
from tokenfab.server.limits import check_metadata

router = APIRouter()
FILE_PURPOSES = ("batch",)


def _service(request: Request) -> BatchService:
    return request.app.state.batches


def _store(request: Request):
    return _service(request).store


def install(app) -> None:
    """The Batch API's routes, and the store's refusals (StoreError) as OpenAI error bodies."""
    app.include_router(router)

    @app.exception_handler(StoreError)
    async def _store_error(_: Request, e: StoreError) -> JSONResponse:
        return APIError(e.status, str(e), param=e.param, code=e.code).response()


# -- files --------------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "upload a file as multipart/form-data with the fields file and purpose", param="file")
    form = await request.form(max_files=1, max_fields=8)
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in FILE_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}",
                           param="purpose", code="invalid_purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form has no file part named 'file'", param="file", code="missing_file")
        data = await upload.read()
        filename = upload.filename or "upload.jsonl"
    finally:
        await form.close()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"a batch file must be UTF-8 JSON lines (bad byte at offset {e.start})",
                       param="file", code="invalid_file") from None
    if not data.strip():
        raise APIError(400, "the file is empty; a batch file holds one JSON request per line",
                       param="file", code="invalid_file")
    return JSONResponse(_store(request).add_file(filename, purpose, data))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> dict:
    return {"object": "list", "data": _store(request).list_files(purpose), "has_more": False}


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict:
    return _store(request).get_file(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    return Response(_store(request).file_content(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict:
    return _store(request).delete_file(file_id)


# -- batches ------------------------------------------------------------------------------------
@router.post("/v1/batches")
async def create_batch(request: Request) -> dict:
    body = parse_json_object(await request.body())
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    if body.get("completion_window") != "24h":
        raise APIError(400, f"completion_window must be \"24h\", got {body.get('completion_window')!r}",
                       param="completion_window")
    metadata = body.get("metadata")
    check_metadata(metadata)
    file_id = body.get("input_file_id")
    store = _store(request)
    try:
        f = store.get_file(file_id) if isinstance(file_id, str) else None
    except StoreError:
        f = None
    if f is None:
        raise APIError(400, f"input_file_id {file_id!r} is not an uploaded file; upload one with POST /v1/files",
                       param="input_file_id", code="file_not_found")
    if f["purpose"] != "batch":
        raise APIError(400, f"file {file_id} has purpose {f['purpose']!r}; a batch needs a file uploaded with "
                            "purpose \"batch\"", param="input_file_id")
    obj = store.create_batch(file_id, endpoint, "24h", metadata, request.app.state.tokenfab.model_name)
    _service(request).submit(obj["id"])
    return obj


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in 1..100, got {limit}", param="limit")
    data, more = _store(request).list_batches(limit, after)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict:
    return _store(request).get_batch(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict:
    return await _service(request).cancel(batch_id)
