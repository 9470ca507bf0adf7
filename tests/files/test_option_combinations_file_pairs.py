"""Two features of a file job at once: a subtitle cue's line count beside an inline voice tag whose name has
spaces; a text file's byte order mark beside each text format (HTML, subtitles, Markdown) and UTF-16, which is
refused; a pivoted job's progress (sentences done of all) across both hops; a job followed for its changes and
cancelled mid-way (the follower hears the end, and the job's engine requests leave the batch). The formats
are read with tests/files/test_formats.py's stand-in translator; the jobs run in an app in this process on
the committed fixture models (tests/files/test_option_combinations_files.py), so that the tests take
seconds."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.files.test_formats import upper_case
from tests.files.test_option_combinations_files import GERMAN, mt, pivot  # noqa: F401 - module fixtures
from tests.helpers.polling import until
from tserve.service.translation import file_jobs
from tserve.service.translation.file_jobs import FileJob
from tserve.service.translation.files import FileRefused, Limits, read_file

# The jobs' outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BOM = "\ufeff"


# --------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------
def test_a_two_line_cue_with_a_named_voice_is_cut_outside_the_tag():
    """A cue's translation is wrapped again into as many lines as it had, at the space nearest to equal
    lengths: a space inside a tag (`<v Anna Maria>`, a speaker's name) is not a place to cut, even where it is
    the nearest, or the tag would be broken over two lines."""
    src = "WEBVTT\n\n00:01.000 --> 00:04.000\n<v Anna Maria>hi</v>\nyo\n"
    assert upper_case("a.vtt", src.encode()).decode() == src.replace("hi</v>\nyo", "HI</v>\nYO")
    two = "WEBVTT\n\n00:05.000 --> 00:06.000\n<v Anna Maria Lee>hello there</v>\nall\n"
    out = upper_case("b.vtt", two.encode()).decode()
    assert "<v Anna Maria Lee>" in out and out.count("\n") == two.count("\n"), out


@pytest.mark.parametrize(("name", "src", "want"), [
    ("a.html", "<p>hello <b>world</b></p>\r\n", "<p>HELLO <b>WORLD</b></p>\r\n"),
    ("a.srt", "1\r\n00:00:01,000 --> 00:00:02,000\r\nhello\r\nworld\r\n",
     "1\r\n00:00:01,000 --> 00:00:02,000\r\nHELLO\r\nWORLD\r\n"),
    ("a.vtt", "WEBVTT\n\n00:01.000 --> 00:02.000\nhello <i>world</i>\n",
     "WEBVTT\n\n00:01.000 --> 00:02.000\nHELLO <i>WORLD</i>\n"),
    ("a.md", "# hello *world*\n", "# HELLO *WORLD*\n"),
    ("a.txt", "hello world.\r\n", "HELLO WORLD.\r\n"),
])
def test_a_byte_order_mark_comes_back_once_in_each_text_format(name, src, want):
    """A UTF-8 file that starts with a byte order mark is read without it (a WebVTT file's first word is still
    WEBVTT) and written with it, once, in every text format, as .txt is: an editor that wrote it reads the
    file the same way again."""
    out = upper_case(name, (BOM + src).encode("utf-8"))
    assert out == (BOM + want).encode("utf-8"), out
    assert upper_case(name, src.encode("utf-8")) == want.encode("utf-8")  # and none where it had none


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_a_utf16_text_file_with_its_byte_order_mark_comes_back_in_utf16(encoding):
    """Windows writes "Unicode" text as UTF-16 with a byte order mark: each text format reads it as text and writes
    the translation back in the same UTF-16 with the same mark. Without a mark, UTF-16's NUL bytes are not text:
    refused as not UTF-8, rather than read byte by byte."""
    bom = "\ufeff".encode(encoding)
    for name, src, want in [("a.txt", "hello world.\r\n", "HELLO WORLD.\r\n"),
                            ("a.srt", "1\r\n00:00:01,000 --> 00:00:02,000\r\nhello\r\n",
                             "1\r\n00:00:01,000 --> 00:00:02,000\r\nHELLO\r\n"),
                            ("a.html", "<p>hello <b>wörld</b></p>\n", "<p>HELLO <b>WÖRLD</b></p>\n"),
                            ("a.md", "# hello *world*\n", "# HELLO *WORLD*\n")]:
        assert upper_case(name, bom + src.encode(encoding)) == bom + want.encode(encoding), name
        with pytest.raises(FileRefused) as exc:
            read_file(name, src.encode(encoding), Limits())
        assert exc.value.code == "file_mismatch", (name, exc.value)


# --------------------------------------------------------------------------------------------------
# Jobs: progress and cancellation
# --------------------------------------------------------------------------------------------------
def test_a_pivoted_jobs_progress_never_passes_its_total(pivot, monkeypatch):  # noqa: F811
    """A pivoted job counts each hop's sentences: when the second hop starts, its total is the first hop's
    sentences done plus the second hop's, so a follower never reads more done than all; the job ends with
    both hops' sentences done of both hops'."""
    seen: list[tuple[int, int]] = []
    progress = FileJob.progress

    def counted(self: FileJob) -> None:
        progress(self)
        seen.append((self.done_segments, self.total_segments))

    monkeypatch.setattr(FileJob, "progress", counted)
    state, _ = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr", cache="false")
    assert seen and all(done <= total for done, total in seen), seen
    assert state["done_segments"] == state["total_segments"] == len(seen)
    assert state["total_segments"] > seen[0][1] // 2  # the second hop's sentences counted beside the first's


LONG = ("the quick brown fox jumps.\nhello world good morning.\n" * 150).encode()  # 300 sentences


def test_a_followed_job_cancelled_mid_way_ends_its_changes_and_frees_its_rows(mt, monkeypatch):  # noqa: F811
    """A job being followed for its changes (what `/events` streams) and cancelled while it runs: the follower
    hears the cancelled state and its changes end (it does not wait on keep-alives forever), and the job's
    sentences leave the engine (no running or queued request of it stays). Progress is told only every
    minute here, so that what the follower hears at the end is the job's end, not a progress change."""
    monkeypatch.setattr(file_jobs, "PROGRESS_EVERY_S", 60.0)
    jobs = mt.app.state.file_jobs

    def gauge(name: str) -> float:
        return mt.app.state.metrics.registry.get_sample_value(name, {"model": "mt"}) or 0.0

    async def go() -> list[dict]:
        transport = httpx.ASGITransport(app=mt.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            resp = await c.post("/v1/translations/files", files={"file": ("long.txt", LONG)},
                                data={"model": "mt", "num_beams": "1", "cache": "false"})
            assert resp.status_code == 202, resp.text
            job = jobs.jobs[resp.json()["id"]]
            states: list[dict] = []

            async def follow() -> None:
                async for state in jobs.changes(job):
                    if state is not None:
                        states.append(state)

            follower = asyncio.create_task(follow())
            await until(lambda: states and job.done_segments > 0, 30)
            assert job.status not in ("succeeded", "failed"), "the job ended before it could be cancelled"
            cancelled = (await c.delete(f"/v1/translations/jobs/{job.id}")).json()
            assert cancelled["status"] == "cancelled" and cancelled["done_segments"] < cancelled["total_segments"]
            heard, _ = await asyncio.wait({follower}, timeout=5)
            assert heard, "the follower never heard the job end"
            await until(lambda: not gauge("tserve_running_requests") and not gauge("tserve_queue_depth"), 10)
            return states

    states = asyncio.run(go())
    assert states[-1]["status"] == "cancelled", states[-1]
