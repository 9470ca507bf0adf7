"""`GET /viewer`: a self-contained page (inline CSS and JS, nothing fetched from elsewhere) that calls
`/v1/models`, `/v1/attention`, `/v1/logit_lens` and `/v1/translations` and draws the answer: a heatmap per
module / layer / head, the cross-attention alignment of a translation, a ViT's [CLS] attention over the image,
a layers × positions grid of the logit lens, and a translated document's segments with their word alignment
and where each inline HTML tag went. The scripts live in their own files and are inlined here, so the page
needs no second request and the CSP can stay closed."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["viewer"])


SCRIPTS = ("viewer.js", "lens.js", "document.js")


@cache
def _page() -> str:
    static = resources.files("service").joinpath("static")
    page = static.joinpath("viewer.html").read_text(encoding="utf-8")
    for name in SCRIPTS:
        page = page.replace(f"/* {name} */", static.joinpath(name).read_text(encoding="utf-8"), 1)
    return page


@router.get("/viewer", response_class=HTMLResponse, include_in_schema=True,
            responses={200: {"content": {"text/html": {}}, "description": "the attention viewer page"}})
async def viewer() -> HTMLResponse:
    # The page's script is inline; forbid loading anything from other origins.
    csp = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return HTMLResponse(_page(), headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache",
                                          "X-Content-Type-Options": "nosniff"})
