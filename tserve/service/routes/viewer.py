"""`GET /viewer`: a self-contained page (inline CSS and JS, nothing fetched from elsewhere) that calls
`/v1/models`, `/v1/attention`, `/v1/logit_lens` and `/v1/translations` and draws the answer: a heatmap per
module / layer / head, the cross-attention alignment of a translation, a ViT's [CLS] attention over the image,
a layers × positions grid of the logit lens, and a translated document's segments with their word alignment
and where each inline HTML tag went. The scripts live in their own files and are inlined here, so the page
needs no second request and the CSP can stay closed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from tserve.service.routes.page import inlined_page, page_response

router = APIRouter(tags=["viewer"])


SCRIPTS = ("viewer.js", "lens.js", "document.js")


@router.get("/viewer", response_class=HTMLResponse, include_in_schema=True,
            responses={200: {"content": {"text/html": {}}, "description": "the attention viewer page"}})
async def viewer() -> HTMLResponse:
    return page_response(inlined_page("viewer.html", SCRIPTS))
