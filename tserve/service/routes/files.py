"""Files: `POST /v1/translations/files` starts a job (202) and `/v1/translations/jobs/{id}` reads it, follows it
(`/events`, server-sent), fetches its file (`/file`) or cancels it (DELETE). LibreTranslate's
`/translate_file` (in tserve/service/routes/libretranslate.py) starts the same job and waits for it. What a file
holds and how it is written again is tserve/service/translation/files/; how jobs live and die is tserve/service/translation/file_jobs.py."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from tserve.service.engine import admission
from tserve.service.errors import APIError, bad_request, not_found
from tserve.service.routes.deps import SSE_HEADERS, ready_registry, served_model, settings
from tserve.service.routes.translations import served_translators
from tserve.service.translation.file_jobs import FileJob, FileJobs
from tserve.service.translation.files import FileDocument, FileRefused, Limits, read_file
from tserve.service.translation.inputs import TranslationAsk
from tserve.service.translation.routing import hop_ask, pick_route
from tserve.service.translation.served import ServedTranslator

router = APIRouter(tags=["files"])
FILE_PATHS = ("/v1/translations/files", "/translate_file")  # bodies up to --max-file-bytes
_UNSAFE_NAME = re.compile(r"[\x00-\x1f\x7f/\\\\]")


def jobs_of(request: Request) -> FileJobs:
    return request.app.state.file_jobs


def owner() -> object:
    """Whose a job is: its API key, when keys are on (anyone with its id otherwise)."""
    client = admission.get().client
    return client if isinstance(client, tuple) and client[0] == "key" else None


def _limits(request: Request) -> Limits:
    s = settings(request)
    return Limits(max_unzipped_bytes=s.max_unzipped_bytes)


async def read_upload(request: Request, upload: object) -> tuple[str, bytes]:
    """The upload's safe base name and bytes: 400 without a file, 413 over --max-file-bytes."""
    if not isinstance(upload, UploadFile):
        raise bad_request("send the file as the multipart field 'file'", "missing_file")
    limit = settings(request).max_file_bytes
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, f"the file exceeds {limit} bytes (--max-file-bytes)", "invalid_request_error",
                       "file_too_large")
    name = _UNSAFE_NAME.sub("_", (upload.filename or "").replace("\\", "/").rsplit("/", 1)[-1])[-200:]
    return name or "file.txt", data


async def start_job(request: Request, filename: str, data: bytes, ask: TranslationAsk, model: str | None,
                    detect: bool = False) -> FileJob:
    """Reads the file, checks the request against every model of the route (4xx now, not a failed job later)
    and starts the job."""
    limits = _limits(request)
    try:
        fdoc = await asyncio.to_thread(read_file, filename, data, limits)
    except FileRefused as exc:
        raise bad_request(str(exc), exc.code) from exc
    reg = ready_registry(request)
    if model is None and (served_translators(request) > 1 or detect):
        sample = [b.text for b in fdoc.markup.blocks[:50]]
        hops = await pick_route(reg, sample, ask.source_lang, ask.target_lang)
    else:
        hops = ((served_model(request, model, ServedTranslator.task), (ask.source_lang, ask.target_lang)),)
    first_ask = replace(hop_ask(ask, hops, 0, []), markups=[fdoc.markup])
    if len(hops) == 1:
        first_ask = replace(first_ask, source_lang=ask.source_lang or hops[0][1][0],
                            target_lang=ask.target_lang or hops[0][1][1])
    # The request against every hop's model once, before the job starts: not a failed job after the first hop.
    asks = [first_ask, *(replace(hop_ask(ask, hops, k, []), markups=[fdoc.markup]) for k in range(1, len(hops)))]
    hop_languages = [hop[0].check(hop_ask_) for hop, hop_ask_ in zip(hops, asks, strict=True)]
    (doc,) = hops[0][0].documents(first_ask, hop_languages[0])

    async def work(job: FileJob) -> tuple[bytes, str]:
        current: FileDocument = fdoc
        hop_doc, written = doc, b""
        for k, hop in enumerate(hops):
            if k:  # the next hop reads the file the one before wrote, its markup placed by each model
                current = await asyncio.to_thread(read_file, filename, written, limits)
                (hop_doc,) = hop[0].documents(replace(asks[k], markups=[current.markup]), hop_languages[k])
                job.total_segments = job.done_segments + len(hop_doc.jobs)
            rendered = await hop[0].translate_blocks(hop_doc, current.escape, ask.cache, job.progress)
            written = await asyncio.to_thread(current.write, rendered)
        return written, current.media_type

    languages = (first_ask.source_lang, hops[-1][1][1] if len(hops) > 1 else first_ask.target_lang)
    return jobs_of(request).start(filename, owner(), languages, [served.name for served, _ in hops],
                                  len(doc.jobs) * len(hops), work)


def _form_int(form: Any, name: str) -> int | None:
    value = form.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.strip().isdigit():
        raise bad_request(f"{name} must be a whole number", f"invalid_{name}")
    return int(value)


def _form_text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be text", "invalid_request")
    return value or None


@router.post("/v1/translations/files", status_code=202,
             responses={400: {"description": "invalid request, unsupported or hostile file"},
                        413: {"description": "file over --max-file-bytes"}, 429: {"description": "queue full"}})
async def create_file_translation(request: Request) -> JSONResponse:
    """Multipart: `file`, `source_lang`, `target_lang`, optional `model`, `num_beams`, `max_tokens`, `glossary`
    (a JSON object of terms), `cache` (false: no translation memory). Answers the job (202)."""
    form = await request.form()
    filename, data = await read_upload(request, form.get("file"))
    glossary = _form_text(form, "glossary")
    try:
        terms = json.loads(glossary) if glossary else None
    except ValueError as exc:
        raise bad_request(f"glossary must be a JSON object of terms ({exc})", "invalid_glossary") from exc
    if terms is not None and not isinstance(terms, dict):
        raise bad_request("glossary must be a JSON object of terms", "invalid_glossary")
    ask = TranslationAsk([], _form_int(form, "num_beams"), _form_int(form, "max_tokens"), 1, terms, False,
                         _form_text(form, "source_lang"), _form_text(form, "target_lang"),
                         cache=(_form_text(form, "cache") or "true").lower() not in ("false", "0", "no"))
    job = await start_job(request, filename, data, ask, _form_text(form, "model"))
    return JSONResponse(job.public(), status_code=202)


def _job(request: Request, job_id: str) -> FileJob:
    job = jobs_of(request).get(job_id, owner())
    if job is None:
        raise not_found(f"no translation job {job_id!r}", "job_not_found")
    return job


@router.get("/v1/translations/jobs/{job_id}", responses={404: {"description": "no such job (or not this key's)"}})
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    return _job(request, job_id).public()


@router.get("/v1/translations/jobs/{job_id}/events", responses={404: {"description": "no such job"}})
async def job_events(job_id: str, request: Request) -> StreamingResponse:
    """Server-sent events: the job's state now and after each change, ending after the last."""
    job = _job(request, job_id)

    async def events():  # noqa: ANN202
        async for state in jobs_of(request).changes(job):
            yield ": keep-alive\n\n" if state is None else f"data: {json.dumps(state)}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def file_response(job: FileJob) -> FileResponse:
    if job.status != "succeeded" or job.path is None or not job.path.exists():
        raise APIError(409, f"the job is {job.status}; its file is there once it has succeeded",
                       "invalid_request_error", "job_not_finished")
    return FileResponse(job.path, media_type=job.media_type, filename=job.filename)


@router.get("/v1/translations/jobs/{job_id}/file", responses={404: {"description": "no such job"},
                                                               409: {"description": "not finished"}})
async def job_file(job_id: str, request: Request) -> FileResponse:
    return file_response(_job(request, job_id))


@router.delete("/v1/translations/jobs/{job_id}", responses={404: {"description": "no such job"}})
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    """A running job is cancelled (its sentences leave the batch at the next step); a finished one is deleted
    with its file."""
    job = _job(request, job_id)
    await jobs_of(request).cancel(job)
    return job.public()
