"""LibreTranslate's API, as its clients send it (browser extensions, editor plugins, `libretranslatepy`):
`POST /translate`, `GET|POST /languages`, `POST /detect`, `GET /frontend/settings`. Bodies are form-encoded
or JSON; the key, when keys are on, comes as `api_key` in the body (or as a Bearer header) and is checked
here, since the middleware cannot read bodies; errors are `{"error": "..."}` (tserve/service/errors.py).

Each served translator whose checkpoint names its languages serves one pair, a multilingual one (NLLB) every
pair of its languages; `source`/`target` pick it, and
`source: "auto"` detects each text's language among those the translators read and the target (a text
already in the target language comes back as it is). The translation
itself is `/v1/translations`' path: documents, continuous batching, beams, HTML."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from tserve.service.connection import while_connected
from tserve.service.errors import (
    LIBRETRANSLATE_DOWNLOAD_PREFIX,
    LIBRETRANSLATE_PATHS,
    APIError,
    InvalidInput,
    bad_request,
    overloaded,
)
from tserve.service.limits import check_input_chars
from tserve.service.routes.deps import log_inputs, ready_registry, settings
from tserve.service.routes.files import file_response, jobs_of, read_upload, start_job
from tserve.service.security import bearer_token
from tserve.service.translation.files import SUPPORTED
from tserve.service.translation.inputs import TranslationAsk, check_count
from tserve.service.translation.languages import language_name
from tserve.service.translation.routing import (
    detect_languages,
    detector,
    pair_list,
    routes_by_pair,
    translate_route,
    translators_by_pair,
)
from tserve.service.translation.served import TranslationOutput

router = APIRouter(tags=["libretranslate"])
KEY_CHECKED_PATHS = LIBRETRANSLATE_PATHS  # the middleware lets these through: the key is in the body
DOWNLOAD_PREFIX = LIBRETRANSLATE_DOWNLOAD_PREFIX  # ... and these: the key that made the file, as api_key
MAX_ALTERNATIVES = 15  # n = alternatives + 1 <= 16, as on /v1/translations


async def _fields(request: Request, files_allowed: bool = False) -> dict[str, Any]:
    """The request's fields: a JSON object, or a form (urlencoded or multipart; a repeated field is a list),
    over the query string's."""
    fields: dict[str, Any] = dict(request.query_params)
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        try:
            data = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the body is not valid JSON ({exc})", "invalid_json") from exc
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object", "invalid_json")
        return fields | data
    form = await request.form()
    for name in form:
        values = form.getlist(name)
        if any(isinstance(v, UploadFile) for v in values) and not (name == "file" and files_allowed):
            raise bad_request(f"{name}: files are not taken here", "invalid_request")
        fields[name] = values if len(values) > 1 else values[0]
    return fields


@asynccontextmanager
async def _key_held(request: Request, fields: dict[str, Any]) -> AsyncIterator[None]:
    """With keys on: the body's `api_key` (or the Bearer key) must be one (403), and it counts as a request
    in flight of that key while the block runs (429 at its limit)."""
    gate = request.app.state.key_gate
    if not gate.enabled:
        yield
        return
    presented = fields.get("api_key") or bearer_token(request.scope)
    if not presented or not isinstance(presented, str):
        raise APIError(403, "an API key is required: send api_key", "invalid_request_error", "invalid_api_key")
    key = gate.match(presented)
    if key is None:
        raise APIError(403, "invalid API key", "invalid_request_error", "invalid_api_key")
    if not gate.enter(key):
        raise overloaded(gate.busy_message())
    gate.admit_as(key)
    try:
        yield
    finally:
        gate.leave(key)


def _texts(fields: dict[str, Any]) -> tuple[list[str], bool]:
    q = fields.get("q")
    if isinstance(q, str) and q.strip():
        return [q], False
    if isinstance(q, list) and q and all(isinstance(t, str) for t in q):
        if not all(t.strip() for t in q):
            raise bad_request("Invalid request: q holds an empty text", "empty_input")
        return q, True
    raise bad_request("Invalid request: missing q parameter (a text, or a list of texts)", "empty_input")


def _code(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"Invalid request: missing {name} parameter", "invalid_request")
    return value.strip()


def _alternatives(fields: dict[str, Any]) -> int:
    value = fields.get("alternatives", 0)
    if isinstance(value, str) and value.strip().isdigit():  # a form sends every field as text
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ALTERNATIVES:
        raise bad_request(f"Invalid request: alternatives must be a whole number from 0 to {MAX_ALTERNATIVES}",
                          "invalid_n")
    return value


async def _detect(texts: list[str], candidates: list[str], html: bool = False) -> list[dict[str, Any]]:
    return [{"language": code, "confidence": confidence}
            for code, confidence in await detect_languages(texts, candidates, html)]


@router.post("/translate", responses={400: {"description": "invalid request or unsupported pair"},
                                      403: {"description": "missing or wrong api_key"},
                                      429: {"description": "overload (Retry-After)"}})
async def translate(request: Request) -> dict[str, Any]:
    """`q` (text or list), `source` (code or "auto"), `target`, `format` (text | html), `alternatives`
    (translations besides the best), `api_key`."""
    fields = await _fields(request)
    async with _key_held(request, fields):
        texts, batch = _texts(fields)
        source, target = _code(fields, "source"), _code(fields, "target")
        fmt = fields.get("format") or "text"
        if fmt not in ("text", "html"):
            raise bad_request(f"{fmt} format is not supported (text or html)", "invalid_format")
        n = _alternatives(fields) + 1
        try:
            check_count(len(texts), settings(request))
        except InvalidInput as exc:
            raise bad_request(str(exc), exc.code) from exc
        pairs = routes_by_pair(ready_registry(request))
        detected = None
        if source == "auto":
            if not any(t == target for _, t in pairs):
                raise bad_request(f"no served translator translates into {target} (served: {pair_list(pairs)})",
                                  "unsupported_pair")
            # Over what the translators read, and the target: a text already in it is answered as it is.
            detected = await _detect(texts, sorted({s for s, _ in pairs} | {target}), fmt == "html")
            sources = [d["language"] for d in detected]
        else:
            sources = [source] * len(texts)
        groups: dict[tuple[str, str], list[int]] = {}
        outputs: list[TranslationOutput | None] = [None] * len(texts)
        for i, src in enumerate(sources):
            if detected is not None and src == target:
                outputs[i] = TranslationOutput(texts[i], [], 0.0, "stop", [(texts[i], 0.0)])
            elif (src, target) not in pairs:
                raise bad_request(f"{src}→{target} is not served (served: {pair_list(pairs)})", "unsupported_pair")
            else:
                groups.setdefault((src, target), []).append(i)
        log_inputs(request, texts)

        async def run(pair: tuple[str, str], idx: list[int]) -> None:
            """Alternatives are the last hop's."""
            hops = pairs[pair]
            last = hops[-1][0]
            ask = TranslationAsk([texts[i] for i in idx], max(last.loaded.generation.num_beams, n), None, n, None,
                                 fmt == "html")
            for i, out in zip(idx, (await translate_route(request, hops, ask)).outputs, strict=True):
                outputs[i], via[i] = out, [served.name for served, _ in hops]

        via: list[list[str] | None] = [None] * len(texts)
        runs = [asyncio.ensure_future(run(pair, idx)) for pair, idx in groups.items()]
        try:
            await asyncio.gather(*runs)
        finally:  # one pair's failure ends the request: the others' work stops too
            for r in runs:
                r.cancel()
    translated = [o.text for o in outputs]
    answer: dict[str, Any] = {"translatedText": translated if batch else translated[0]}
    if n > 1:
        others = [[text for text, _ in o.alternatives[1:]] for o in outputs]
        answer["alternatives"] = others if batch else others[0]
    if detected is not None:
        answer["detectedLanguage"] = detected if batch else detected[0]
    if any(v is not None and len(v) > 1 for v in via):  # pivoted: the models each text went through, in order
        answer["models"] = via if batch else via[0]
    return answer


@router.get("/languages")
@router.post("/languages", operation_id="languages_post")  # some clients POST it
async def languages(request: Request) -> list[dict[str, Any]]:
    """Every language a served translator reads or writes, with the targets it can be translated into (directly
    or through --pivot-language)."""
    pairs = routes_by_pair(ready_registry(request))
    codes = sorted({c for pair in pairs for c in pair})
    return [{"code": c, "name": language_name(c), "targets": sorted(t for s, t in pairs if s == c)} for c in codes]


@router.post("/detect", responses={400: {"description": "missing q"}, 403: {"description": "missing or wrong api_key"}})
async def detect(request: Request) -> list[dict[str, Any]]:
    """The languages `q` may be in, best first, confidence 0-100, over the languages the served translators
    read or write (every language the detector knows when none says)."""
    fields = await _fields(request)
    async with _key_held(request, fields):
        q = fields.get("q")
        if not isinstance(q, str) or not q.strip():
            raise bad_request("Invalid request: missing q parameter", "empty_input")
        try:
            check_input_chars(q, settings(request).max_input_chars, "q")
        except InvalidInput as exc:
            raise bad_request(str(exc), exc.code) from exc
        served = sorted({code for pair in translators_by_pair(ready_registry(request)) for code in pair})
        ranked = await asyncio.to_thread(detector.rank, q, served)
    return [{"language": code, "confidence": confidence} for code, confidence in ranked[:10]]


@router.get("/frontend/settings")
async def frontend_settings(request: Request) -> dict[str, Any]:
    """What LibreTranslate's web UI and the clients that probe it read before they start."""
    pairs = sorted(translators_by_pair(ready_registry(request)))
    source, target = pairs[0] if pairs else ("auto", "en")
    keys = request.app.state.key_gate.enabled
    return {"charLimit": settings(request).max_input_chars, "frontendTimeout": 500, "apiKeys": keys,
            "keyRequired": keys, "suggestions": False, "filesTranslation": True,
            "supportedFilesFormat": list(SUPPORTED),
            "language": {"source": {"code": source, "name": language_name(source) if pairs else "Auto Detect"},
                         "target": {"code": target, "name": language_name(target)}}}


@router.post("/translate_file", responses={400: {"description": "invalid request, unsupported or hostile file"},
                                           403: {"description": "missing or wrong api_key"},
                                           413: {"description": "file over --max-file-bytes"}})
async def translate_file(request: Request) -> dict[str, Any]:
    """Multipart `file`, `source` (code or "auto"), `target`, `api_key`: the file translated (the same job as
    `/v1/translations/files`, waited for while the client stays), answered as `translatedFileUrl`."""
    fields = await _fields(request, files_allowed=True)
    async with _key_held(request, fields):
        filename, data = await read_upload(request, fields.get("file"))
        source, target = _code(fields, "source"), _code(fields, "target")
        auto = source == "auto"
        ask = TranslationAsk([], None, None, 1, None, False, None if auto else source, target)
        job = await start_job(request, filename, data, ask, None, detect=auto)
        try:
            await while_connected(request, asyncio.shield(job.task))
        finally:
            if job.status not in ("succeeded", "failed", "cancelled"):
                await jobs_of(request).cancel(job)
    if job.status != "succeeded":
        raise APIError(500 if (job.error or {}).get("type") == "server_error" else 400,
                       (job.error or {}).get("message", f"the translation {job.status}"), "invalid_request_error")
    return {"translatedFileUrl": f"{str(request.base_url).rstrip('/')}{DOWNLOAD_PREFIX}{job.id}.{job.filename}"}


@router.get(DOWNLOAD_PREFIX + "{name:path}", responses={404: {"description": "no such file (or not this key's)"}})
async def download_file(name: str, request: Request) -> Any:
    """A file `/translate_file` made; with keys on, only with the key that made it (`api_key` or Bearer)."""
    gate = request.app.state.key_gate
    owner = None
    if gate.enabled:
        key = gate.match(request.query_params.get("api_key") or bearer_token(request.scope))
        owner = None if key is None else ("key", key)
    job = jobs_of(request).get(name.split(".", 1)[0], owner)
    if job is None or (gate.enabled and owner is None):
        raise APIError(404, "no such file", "invalid_request_error", "job_not_found")
    return file_response(job)
