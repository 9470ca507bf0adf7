"""The requests of README.md's quick start work as written, against what `make serve` serves: every checkpoint
under models/, no --model. The `curl` commands are read out of the quick start's code blocks (method, path,
headers, JSON body) and sent to a real server; each answer must be a 200 of the shape the route promises."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SERVE_PORT = 8000  # what `make serve` listens on (tserve's default --port)


@dataclass
class CurlRequest:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: str | None = None

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


def quick_start() -> str:
    """README.md's quick start section: from its heading to the next heading (a `#` line inside a code block is a
    shell comment, not a heading)."""
    lines, inside, fenced = [], False, False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            if inside:
                break
            inside = line.strip() == "## Quick start"
            continue
        if inside:
            lines.append(line)
    return "\n".join(lines)


def curl_commands(section: str) -> list[str]:
    """The `curl` command lines of the section's fenced code blocks, continuation lines joined."""
    commands, fenced, pending = [], False, ""
    for line in section.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.startswith("curl "):
            commands.append(line)
    return commands


def parse_curl(command: str) -> CurlRequest:
    """Method, path, headers and body of one `curl` command (the options the README uses; others fail)."""
    words = shlex.split(command, comments=True)
    assert words[0] == "curl", command
    url = method = body = None
    headers: dict[str, str] = {}
    i = 1
    while i < len(words):
        word = words[i]
        if word in ("-H", "--header"):
            name, _, value = words[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif word in ("-d", "--data", "--data-raw"):
            body = words[i + 1]
            i += 2
        elif word in ("-X", "--request"):
            method = words[i + 1]
            i += 2
        elif word in ("-N", "--no-buffer", "-s", "--silent", "-i"):
            i += 1
        elif word.startswith("-"):
            raise AssertionError(f"option {word} of {command!r} is not understood by this test")
        else:
            assert url is None, f"two URLs in {command!r}"
            url = word
            i += 1
    assert url, f"no URL in {command!r}"
    parts = urlsplit(url if "://" in url else f"http://{url}")
    assert parts.hostname in ("localhost", "127.0.0.1") and parts.port == SERVE_PORT, \
        f"{url}: `make serve` listens on localhost:{SERVE_PORT}"
    return CurlRequest(method or ("POST" if body is not None else "GET"), parts.path or "/", headers, body)


REQUESTS = [parse_curl(c) for c in curl_commands(quick_start())]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--no-warmup"], tmp_path_factory.mktemp("quick-start") / "server.log")
    yield srv.wait_ready()
    srv.stop()


def check_completion(answer: httpx.Response) -> None:
    choice = answer.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert isinstance(text, str) and text.strip(), answer.text
    assert choice["finish_reason"] in ("stop", "length"), answer.text


def check_translation(answer: httpx.Response) -> None:
    data = answer.json()
    assert data["object"] == "translation", answer.text
    assert data["data"] and all(item["translation"].strip() for item in data["data"]), answer.text


def check_page(answer: httpx.Response) -> None:
    assert answer.headers["content-type"].startswith("text/html"), answer.headers
    assert "<html" in answer.text.lower()


CHECKS = {
    ("POST", "/v1/completions"): check_completion,
    ("POST", "/v1/chat/completions"): check_completion,
    ("POST", "/v1/translations"): check_translation,
    ("GET", "/"): check_page,
}


def test_the_quick_start_shows_a_generation_a_translation_and_the_page():
    kinds = {(r.method, r.path) for r in REQUESTS}
    assert kinds & {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}, kinds
    assert ("POST", "/v1/translations") in kinds, kinds
    assert ("GET", "/") in kinds, kinds
    for request in REQUESTS:
        assert (request.method, request.path) in CHECKS, f"{request.name}: no check for this route here"
        if request.body is not None:
            json.loads(request.body)  # the README's body is JSON as written


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.name)
def test_quick_start_request_works_on_the_bundled_models(server, request_):
    answer = httpx.request(request_.method, server.url + request_.path, headers=request_.headers,
                           content=request_.body.encode() if request_.body is not None else None, timeout=120)
    assert answer.status_code == 200, f"{request_.name}: {answer.status_code} {answer.text[:500]}"
    CHECKS[(request_.method, request_.path)](answer)
