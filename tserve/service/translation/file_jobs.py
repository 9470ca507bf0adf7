"""Files translated as jobs: a file becomes one document job in the running batch and is answered at once
with a job id; its progress (sentences done of all) can be read or followed as it changes; DELETE cancels it
(its engine requests are cancelled, so their rows are free at the next step). A finished file waits in
`--file-dir` under its job's id (32 random bytes: not guessable) for `--file-retention-s`, then it and its
job are deleted. With API keys on, a job and its file belong to the key that made it: another key reads a 404."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tserve.service.errors import APIError

log = logging.getLogger("tserve.files")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
KEEPALIVE_S = 15.0
PROGRESS_EVERY_S = 0.25


@dataclass
class FileJob:
    id: str
    filename: str
    owner: object  # the API key's index when keys are on, else None
    source_lang: str | None
    target_lang: str | None
    models: list[str]
    total_segments: int
    status: str = "queued"
    done_segments: int = 0
    created: float = field(default_factory=time.time)
    finished: float | None = None
    error: dict[str, Any] | None = None
    path: Path | None = None
    media_type: str = "application/octet-stream"
    task: asyncio.Task | None = None
    version: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _notifying: bool = False

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "translation.job", "status": self.status, "filename": self.filename,
                "source_lang": self.source_lang, "target_lang": self.target_lang, "models": self.models,
                "done_segments": self.done_segments, "total_segments": self.total_segments,
                "created": int(self.created), "finished": None if self.finished is None else int(self.finished),
                "download_url": f"/v1/translations/jobs/{self.id}/file", "error": self.error}

    async def notify(self) -> None:
        async with self.changed:
            self.version += 1
            self.changed.notify_all()

    def progress(self) -> None:
        """One more sentence done (called in the event loop). Followers hear of it at most every
        PROGRESS_EVERY_S: on a small machine every wake-up of the event loop takes CPU from the model."""
        self.done_segments += 1
        self.status = "running"
        if not self._notifying:
            self._notifying = True
            asyncio.get_running_loop().call_later(PROGRESS_EVERY_S, self._notify_progress)

    def _notify_progress(self) -> None:
        self._notifying = False
        asyncio.ensure_future(self.notify())


class FileJobs:
    def __init__(self, directory: str | None, retention_s: float, metrics: Any) -> None:
        self.directory = Path(directory) if directory else Path(tempfile.gettempdir()) / "tserve-files"
        self.retention_s, self.metrics = retention_s, metrics
        self.jobs: dict[str, FileJob] = {}
        self._sweeper: asyncio.Task | None = None

    def start(self, filename: str, owner: object, languages: tuple[str | None, str | None], models: list[str],
              total_segments: int, work: Callable[[FileJob], Awaitable[tuple[bytes, str]]]) -> FileJob:
        """A job running `work` (which returns the translated file and its media type) in the background."""
        self.directory.mkdir(parents=True, exist_ok=True)
        job = FileJob(secrets.token_urlsafe(32), filename, owner, languages[0], languages[1], models, total_segments)
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, work))
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_forever())
        return job

    async def _run(self, job: FileJob, work: Callable[[FileJob], Awaitable[tuple[bytes, str]]]) -> None:
        try:
            data, job.media_type = await work(job)
            path = self.directory / (job.id + Path(job.filename).suffix.lower())
            await asyncio.to_thread(path.write_bytes, data)
            job.path, job.status = path, "succeeded"
            job.done_segments = job.total_segments
        except asyncio.CancelledError:
            job.status = "cancelled"
        except Exception as exc:  # the job's failure is its answer, never the server's
            job.status = "failed"
            job.error = _error_of(exc)
            log.warning("file job failed", extra={"job": job.id, "error": job.error["message"]})
        finally:
            job.finished = time.time()
            self.metrics.file_jobs.labels(job.status).inc()
            await job.notify()

    def get(self, job_id: str, owner: object) -> FileJob | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    async def cancel(self, job: FileJob) -> None:
        """A running job stops (its sentences leave the batch at the next step); a finished one is deleted
        with its file."""
        if job.status not in TERMINAL and job.task is not None:
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task
        else:
            self._delete(job)

    async def changes(self, job: FileJob) -> AsyncIterator[dict[str, Any] | None]:
        """The job's state now and after each change, until it ends; None every KEEPALIVE_S without one."""
        seen = -1
        while True:
            if job.version != seen:
                seen = job.version
                yield job.public()
                if job.status in TERMINAL:
                    return
            async with job.changed:
                try:
                    await asyncio.wait_for(job.changed.wait_for(lambda seen=seen: job.version != seen), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield None

    def _delete(self, job: FileJob) -> None:
        self.jobs.pop(job.id, None)
        if job.path is not None:
            job.path.unlink(missing_ok=True)

    def sweep(self, now: float | None = None) -> int:
        """Deletes the jobs (and files) that ended more than --file-retention-s ago; how many."""
        now = time.time() if now is None else now
        expired = [j for j in self.jobs.values() if j.finished is not None and now - j.finished > self.retention_s]
        for job in expired:
            self._delete(job)
        return len(expired)

    async def _sweep_forever(self) -> None:
        while self.jobs:
            await asyncio.sleep(min(self.retention_s / 4, 60.0))
            self.sweep()

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            await self.cancel(job)
        if self._sweeper is not None:
            self._sweeper.cancel()


def _error_of(exc: Exception) -> dict[str, Any]:
    """An engine failure keeps its type and code (a queue that stayed full, a glossary that cannot fit)."""
    if isinstance(exc, APIError):
        return {"message": exc.message, "type": exc.type, "code": exc.code}
    return {"message": str(exc) or type(exc).__name__, "type": "server_error", "code": None}
