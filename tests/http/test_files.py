"""Files through a real server: each format translated by a model whose alignment is known (the lexicon
fixture translates word i to word i), its formatting runs on exactly the translated words and its other parts
byte-identical; jobs with progress (polled and as events), cancel, retention and per-key ownership;
LibreTranslate's /translate_file and /download_file; hostile files over HTTP; the translation memory answering
repeated sentences, opted out of per request, and surviving a restart."""

from __future__ import annotations

import io
import json
import re
import time
import zipfile

import httpx
import pytest

from tests.files.test_formats import MARKED, SENTENCES, TRANSLATED_PARTS
from tests.helpers import factories
from tests.helpers.fixture_training import LEXICON, assert_greedy_margins
from tests.helpers.office_files import FORMATS, build, read_back
from tests.helpers.server import ServerProcess
from tserve.model.checkpoint import load

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

TARGET = [[LEXICON[w] for w in s] for s in SENTENCES]


@pytest.fixture(scope="module")
def aligned_mt(tmp_path_factory):
    d = factories.aligned_mt_dir(tmp_path_factory.mktemp("aligned-mt"))
    loaded = load(d)
    for source, target in zip(SENTENCES, TARGET, strict=True):  # word for word, by margins rounding cannot flip
        assert_greedy_margins(loaded, " ".join(source), " ".join(target))
    return d


@pytest.fixture(scope="module")
def server(aligned_mt, tmp_path_factory):
    work = tmp_path_factory.mktemp("files")
    srv = ServerProcess(["--model", f"mt={aligned_mt}", "--file-dir", str(work / "out"), "--max-file-bytes",
                         "300000", "--max-unzipped-bytes", "2000000", "--translation-memory",
                         str(work / "memory.sqlite")], work / "server.log").wait_ready()
    yield srv
    srv.stop()


def upload(server, name: str, data: bytes, status: int = 202, headers: dict | None = None, **fields) -> dict:
    resp = httpx.post(server.url + "/v1/translations/files", files={"file": (name, data)},
                      data={"num_beams": "1"} | fields, headers=headers, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def finished(server, job: dict, headers: dict | None = None, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{server.url}/v1/translations/jobs/{job['id']}", headers=headers, timeout=10).json()
        if state["status"] in ("succeeded", "failed", "cancelled"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"job still {state}")


def translated(server, name: str, data: bytes, **fields) -> bytes:
    job = finished(server, upload(server, name, data, **fields))
    assert job["status"] == "succeeded", job
    assert job["done_segments"] == job["total_segments"] > 0
    resp = httpx.get(server.url + job["download_url"], timeout=30)
    assert resp.status_code == 200
    assert f'filename="{name}"' in resp.headers["content-disposition"]
    return resp.content


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_comes_back_translated_with_its_runs_on_the_aligned_words(server, fmt):
    data = build(fmt, SENTENCES, MARKED)
    out = translated(server, f"file.{fmt}", data, cache="false")
    paragraphs, marked = read_back(fmt, out)
    assert paragraphs == [" ".join(t) for t in TARGET]
    if fmt != "txt":
        assert marked == [" ".join(TARGET[0][2:4]), TARGET[1][1]]
    if fmt in TRANSLATED_PARTS:
        with zipfile.ZipFile(io.BytesIO(data)) as before, zipfile.ZipFile(io.BytesIO(out)) as after:
            changed = {n for n in before.namelist() if before.read(n) != after.read(n)}
        assert changed <= TRANSLATED_PARTS[fmt]


def test_libretranslate_translates_a_file_and_serves_it_for_download(server):
    settings = httpx.get(server.url + "/frontend/settings").json()
    assert settings["filesTranslation"] is True and ".docx" in settings["supportedFilesFormat"]
    resp = httpx.post(server.url + "/translate_file", files={"file": ("a.docx", build("docx", SENTENCES, MARKED))},
                      data={"source": "en", "target": "de"}, timeout=120)
    assert resp.status_code == 200, resp.text
    url = resp.json()["translatedFileUrl"]
    assert re.fullmatch(re.escape(server.url) + r"/download_file/[\w-]{40,}\.a\.docx", url), url
    paragraphs, marked = read_back("docx", httpx.get(url).content)
    assert paragraphs == [" ".join(t) for t in TARGET]
    assert httpx.get(url[: url.rindex("/") + 1] + "nosuchjob.a.docx").status_code == 404
    bad = httpx.post(server.url + "/translate_file", files={"file": ("a.exe", b"MZ")},
                     data={"source": "en", "target": "de"})
    assert bad.status_code == 400 and "supported" in bad.json()["error"]


def test_hostile_and_wrong_files_are_4xx_naming_what_is_wrong(server):
    too_big = upload(server, "a.txt", b"hello world. " * 30000, 413)
    assert too_big["error"]["code"] == "file_too_large"
    with zipfile.ZipFile(io.BytesIO(build("docx", SENTENCES, MARKED))) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        for n, body in (entries | {"word/media/zeros.bin": bytes(4_000_000)}).items():
            z.writestr(n, body)
    assert upload(server, "bomb.docx", bomb.getvalue(), 400)["error"]["code"] == "hostile_file"
    mismatch = upload(server, "report.docx", b"plain text", 400)["error"]
    assert mismatch["code"] == "file_mismatch" and ".pptx" in mismatch["message"]
    assert upload(server, "a.pdf", b"%PDF", 400)["error"]["code"] == "unsupported_file"
    resp = httpx.post(server.url + "/v1/translations/files", data={"target_lang": "de"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "missing_file"
    assert upload(server, "a.txt", b"hello", 404, model="nope")["error"]["code"] == "model_not_found"
    assert upload(server, "a.txt", b"hello", 400, num_beams="99")["error"]["code"] == "invalid_num_beams"


def _metric(server, name: str) -> float:
    """A sample without labels (the translation memory's entries are the process's, not a model's)."""
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_repeated_sentence_is_answered_from_the_memory_unless_the_request_opts_out(server):
    body = {"model": "mt", "input": "three small daughters know the king", "num_beams": 1}
    first = httpx.post(server.url + "/v1/translations", json=body).json()["data"][0]["translation"]
    hits = server.metric("tserve_translation_memory_hits_total", "mt", 0.0)
    tokens = server.metric("tserve_generated_tokens_total", "mt", 0.0)
    again = httpx.post(server.url + "/v1/translations", json=body).json()["data"][0]["translation"]
    assert again == first
    assert server.metric("tserve_translation_memory_hits_total", "mt", 0.0) == hits + 1
    assert server.metric("tserve_generated_tokens_total", "mt", 0.0) == tokens  # the engine did nothing
    fresh = httpx.post(server.url + "/v1/translations", json=body | {"cache": False}).json()["data"][0]["translation"]
    assert fresh == first and server.metric("tserve_translation_memory_hits_total", "mt", 0.0) == hits + 1
    assert server.metric("tserve_generated_tokens_total", "mt", 0.0) > tokens
    assert _metric(server, "tserve_translation_memory_entries") >= 1
    # Other decoding options are another translation: not answered from this one.
    short = httpx.post(server.url + "/v1/translations", json=body | {"max_tokens": 2}).json()["data"][0]
    assert short["translation"] != first and server.metric("tserve_translation_memory_hits_total", "mt", 0.0) == hits + 1


def _streamed(server, body: dict) -> list[dict]:
    """A streamed `/v1/translations` answer's chunks."""
    with httpx.stream("POST", server.url + "/v1/translations", json=body | {"stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("text", ["the quick brown fox jumps", "hello world. good morning\nthe lazy dog"],
                         ids=["one-sentence-tokens", "document-segments"])
def test_a_streamed_translation_is_answered_from_the_memory_as_a_fresh_one_would_be(server, text):
    """Streams take the one path too: a stream fills the memory (a plain request then answers from it) and is
    answered from it (no token generated), its chunks' final translation, score and usage those of a fresh
    translation; `cache: false` translates again."""
    body = {"model": "mt", "input": text, "num_beams": 1}
    fresh = _streamed(server, body | {"cache": False})
    assert fresh[-1]["finish_reason"] == "stop"  # (what stops at its length is not kept)
    first = _streamed(server, body)  # translated (the module's other tests never ask for this text), and kept
    tokens = server.metric("tserve_generated_tokens_total", "mt", 0.0)
    hits = server.metric("tserve_translation_memory_hits_total", "mt", 0.0)
    plain = httpx.post(server.url + "/v1/translations", json=body).json()["data"][0]
    again = _streamed(server, body)
    assert server.metric("tserve_generated_tokens_total", "mt", 0.0) == tokens  # the engine did nothing
    assert server.metric("tserve_translation_memory_hits_total", "mt", 0.0) >= hits + 2
    for answer in (first, again):
        assert answer[-1]["data"][0]["translation"] == fresh[-1]["data"][0]["translation"] == plain["translation"]
        assert "".join(c["data"][0]["delta"] for c in answer) == plain["translation"]
        assert answer[-1]["data"][0]["score"] == pytest.approx(plain["score"], abs=1e-4)
        assert answer[-1]["usage"] == fresh[-1]["usage"] and answer[-1]["finish_reason"] == "stop"
    _streamed(server, body | {"cache": False})
    assert server.metric("tserve_generated_tokens_total", "mt", 0.0) > tokens


def test_the_memory_survives_a_restart(aligned_mt, tmp_path):
    args = ["--model", f"mt={aligned_mt}", "--translation-memory", str(tmp_path / "tm.sqlite")]
    body = {"model": "mt", "input": "hello world\ngood morning", "num_beams": 1}
    first = ServerProcess(args, tmp_path / "one.log").wait_ready()
    try:
        before = httpx.post(first.url + "/v1/translations", json=body).json()["data"][0]["translation"]
    finally:
        first.stop()
    second = ServerProcess(args, tmp_path / "two.log").wait_ready()
    try:
        assert _metric(second, "tserve_translation_memory_entries") == 2  # held from the start, before any request
        tokens = second.metric("tserve_generated_tokens_total", "mt", 0.0)
        after = httpx.post(second.url + "/v1/translations", json=body).json()["data"][0]["translation"]
        assert after == before
        assert second.metric("tserve_translation_memory_hits_total", "mt", 0.0) == 2  # both sentences
        assert second.metric("tserve_generated_tokens_total", "mt", 0.0) == tokens
    finally:
        second.stop()


# --------------------------------------------------------------------------------------------------
# Jobs: progress, cancel, retention, keys (every engine step slowed, so a job is seen running)
# --------------------------------------------------------------------------------------------------
K1, K2 = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
LONG = ("the quick brown fox jumps.\nhello world good morning.\n" * 20).encode()  # 40 sentences, 8 rows at a time


@pytest.fixture(scope="module")
def slow(aligned_mt, tmp_path_factory):
    work = tmp_path_factory.mktemp("slow")
    srv = ServerProcess(["--model", f"mt={aligned_mt}", "--api-keys", "key-one,key-two", "--file-dir",
                         str(work / "out"), "--file-retention-s", "1.5", "--max-running-requests", "8",
                         "--translation-memory-max-entries", "0"], work / "server.log",
                        step_delay_s=0.02).wait_ready()
    srv.file_dir = work / "out"
    yield srv
    srv.stop()


def test_progress_events_follow_a_job_to_its_end(slow):
    job = upload(slow, "long.txt", LONG, headers=K1)
    assert job["status"] == "queued" and job["total_segments"] == 40 and job["done_segments"] == 0
    states = []
    with httpx.stream("GET", f"{slow.url}/v1/translations/jobs/{job['id']}/events", headers=K1, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                states.append(json.loads(line[6:]))
    done = [s["done_segments"] for s in states]
    assert done == sorted(done) and len(set(done)) > 2  # progress seen on the way
    assert states[-1]["status"] == "succeeded" and states[-1]["done_segments"] == 40


def test_delete_cancels_a_running_job_and_frees_its_rows(slow):
    job = upload(slow, "long.txt", LONG, headers=K1)
    deadline = time.monotonic() + 60
    while httpx.get(f"{slow.url}/v1/translations/jobs/{job['id']}", headers=K1).json()["done_segments"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancelled = httpx.delete(f"{slow.url}/v1/translations/jobs/{job['id']}", headers=K1).json()
    assert cancelled["status"] == "cancelled" and cancelled["done_segments"] < 40
    deadline = time.monotonic() + 10
    while slow.metric("tserve_running_requests", "mt", 0.0) or slow.metric("tserve_queue_depth", "mt", 0.0):
        assert time.monotonic() < deadline, "the job's sentences still hold rows"
        time.sleep(0.05)
    assert httpx.get(slow.url + cancelled["download_url"], headers=K1).status_code == 409


def test_a_job_and_its_file_belong_to_the_key_that_made_it(slow):
    job = finished(slow, upload(slow, "a.md", build("md", SENTENCES, MARKED), headers=K1), K1)
    url = f"{slow.url}/v1/translations/jobs/{job['id']}"
    assert httpx.get(url, headers=K2).status_code == 404
    assert httpx.get(url + "/file", headers=K2).status_code == 404
    assert httpx.delete(url, headers=K2).status_code == 404
    assert httpx.get(url).status_code == 401
    assert httpx.get(url + "/file", headers=K1).status_code == 200
    # LibreTranslate's download link works only with the key that made the file.
    resp = httpx.post(slow.url + "/translate_file", files={"file": ("b.txt", b"hello world")},
                      data={"source": "en", "target": "de", "api_key": "key-two"}, timeout=60)
    link = resp.json()["translatedFileUrl"]
    assert httpx.get(link).status_code == 404 and httpx.get(link + "?api_key=key-one").status_code == 404
    assert httpx.get(link + "?api_key=key-two").text == "Hallo Welt"


def test_finished_files_are_deleted_after_the_retention(slow):
    job = finished(slow, upload(slow, "short.txt", b"hello world", headers=K1), K1)
    assert job["status"] == "succeeded"
    stored = list(slow.file_dir.iterdir())
    assert any(p.name.startswith(job["id"]) for p in stored)
    assert not any("short" in p.name for p in stored)  # stored under its job's id, not the name it came with
    deadline = time.monotonic() + 10
    while httpx.get(f"{slow.url}/v1/translations/jobs/{job['id']}", headers=K1).status_code != 404:
        assert time.monotonic() < deadline, "kept past --file-retention-s"
        time.sleep(0.1)
    assert not any(p.name.startswith(job["id"]) for p in slow.file_dir.iterdir())
