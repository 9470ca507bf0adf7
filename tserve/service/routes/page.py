"""`GET /`: the translation page (inline CSS and JS, nothing fetched from elsewhere). It calls `/languages`,
`/frontend/settings`, `/detect`, `/v1/translations` and the file jobs under `/v1/translations/files` and
`/v1/translations/jobs/`. The scripts live in their own files and are inlined here, so the page needs no second
request and the CSP can stay closed."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["page"])


SCRIPTS = ("translate.js", "files.js")


@cache
def inlined_page(html: str, scripts: tuple[str, ...]) -> str:
    """A page of tserve/service/static/ with each script's `/* name */` placeholder replaced by the script."""
    static = resources.files("tserve.service").joinpath("static")
    page = static.joinpath(html).read_text(encoding="utf-8")
    for name in scripts:
        page = page.replace(f"/* {name} */", static.joinpath(name).read_text(encoding="utf-8"), 1)
    return page


def page_response(page: str) -> HTMLResponse:
    # The page's scripts are inline; forbid loading anything from other origins.
    csp = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return HTMLResponse(page, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff"})


@router.get("/", response_class=HTMLResponse, include_in_schema=True,
            responses={200: {"content": {"text/html": {}}, "description": "the translation page"}})
async def translation_page() -> HTMLResponse:
    return page_response(inlined_page("translate.html", SCRIPTS))
