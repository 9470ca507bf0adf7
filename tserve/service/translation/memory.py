"""A translation memory: finished sentence translations kept in SQLite, so that a repeated sentence is
answered without running the model, also after a restart. It stores, for each key, the hypotheses a
translation gave (text, token ids, score) as JSON.

The key (`memory_key`) is a sha256 of canonical JSON of everything that decides the output: the model's name,
a hash of its weight files (`weights_hash`: new weights under the same name miss), the languages, the decoding
options and the source sentence, normalised (`normalise_source`: whitespace and Unicode composition aside).

The bound: at most `max_entries` rows. Each get hit and put stamps its row as most recently used; writes
then delete the least recently used rows beyond the bound.

WAL: a file database is opened in write-ahead-log mode with a busy timeout, because several processes
(e.g. Ray Serve replicas on one node) read and write the same file at once: under WAL, readers never wait for
the writer and the writer never waits for readers, and writers queue on the busy timeout instead of failing.
A write still locked out after a few retries is dropped with a warning: the memory is a cache, and a failed
write must never fail the translation that produced it. Likewise a stored value that cannot be read back is a
miss (and is deleted), never an exception."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tserve.translation_memory")

# Part of every key: bump it when the stored value's format or the key's parts change, so old rows miss.
KEY_FORMAT_VERSION = 2  # 2: the sentence as its source ids (1: its text, normalised)
WRITE_ATTEMPTS = 3
_CHUNK_BYTES = 1 << 20

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value TEXT NOT NULL, used INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used)",
    # The row count, kept by triggers, so that the bound is checked without counting the table on each write.
    "CREATE TABLE IF NOT EXISTS entry_count (n INTEGER NOT NULL)",
    "INSERT INTO entry_count (n) SELECT COUNT(*) FROM entries WHERE NOT EXISTS (SELECT 1 FROM entry_count)",
    "CREATE TRIGGER IF NOT EXISTS entries_counted_in AFTER INSERT ON entries "
    "BEGIN UPDATE entry_count SET n = n + 1; END",
    "CREATE TRIGGER IF NOT EXISTS entries_counted_out AFTER DELETE ON entries "
    "BEGIN UPDATE entry_count SET n = n - 1; END",
)


@dataclass(frozen=True)
class StoredHypothesis:
    text: str
    token_ids: list[int]
    score: float


def memory_key(model: str, weights_hash: str, source_lang: str | None, target_lang: str | None,
               options: dict, source_ids: list[int]) -> str:
    """A stable sha256 hex digest of canonical JSON (sorted keys) of all the parts. The sentence is the ids the
    model reads, not its text: two spellings its tokenizer reads alike (a normalising one: NFKC, whitespace) share
    an answer, and two it reads apart (a byte-level one: a no-break space, NFD accents) never do. `options` are the
    decoding options and must be JSON-serialisable (TypeError otherwise)."""
    parts = {"version": KEY_FORMAT_VERSION, "model": model, "weights": weights_hash,
             "source_lang": source_lang, "target_lang": target_lang, "options": options,
             "source_ids": [int(i) for i in source_ids]}
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def weights_hash(paths: list[pathlib.Path]) -> str:
    """blake2b over each file's name, size and bytes (read in 1 MiB chunks), in sorted name order."""
    digest = hashlib.blake2b(digest_size=32)
    for path in sorted((pathlib.Path(p) for p in paths), key=lambda p: (p.name, str(p))):
        name = path.name.encode("utf-8")
        # Lengths first, so that no two different (name, bytes) sequences hash the same stream.
        digest.update(len(name).to_bytes(8, "little") + name + path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as weights:
            while chunk := weights.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def _encode(hypotheses: list[StoredHypothesis]) -> str:
    # int() and float(): token ids and scores may arrive as numpy or torch scalars, which json cannot write.
    return json.dumps([{"text": str(h.text), "token_ids": [int(t) for t in h.token_ids],
                        "score": float(h.score)} for h in hypotheses], ensure_ascii=False)


def _decode(raw: bytes) -> list[StoredHypothesis] | None:
    """The hypotheses in a stored value, or None where it is not one this module wrote."""
    try:
        items = json.loads(raw.decode("utf-8"))
        hypotheses = [StoredHypothesis(item["text"], item["token_ids"], item["score"]) for item in items]
    except (AttributeError, TypeError, KeyError, ValueError):
        return None
    valid = isinstance(items, list) and items and all(
        isinstance(h.text, str) and isinstance(h.token_ids, list) and all(type(t) is int for t in h.token_ids)
        and type(h.score) in (int, float) for h in hypotheses)
    return [StoredHypothesis(h.text, h.token_ids, float(h.score)) for h in hypotheses] if valid else None


def _is_locked(error: sqlite3.Error) -> bool:
    # "database is locked" (SQLITE_BUSY) and "database table is locked" (SQLITE_LOCKED)
    return isinstance(error, sqlite3.OperationalError) and "locked" in str(error)


class TranslationMemory:
    """Sentence translations by `memory_key`, bounded, least recently used first out. Thread-safe: one
    connection, used under a lock. Counters since creation: `hits`, `misses`."""

    def __init__(self, path: str | os.PathLike | None, max_entries: int, busy_timeout_s: float = 2.0) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.path = None if path is None else os.fspath(path)
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        # Autocommit (isolation_level None): transactions are the explicit BEGIN IMMEDIATE ... COMMIT below.
        self._db = sqlite3.connect(":memory:" if path is None else self.path, timeout=busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)
        if path is not None:
            deadline = time.monotonic() + WRITE_ATTEMPTS * max(busy_timeout_s, 1.0)
            if self._switch_to_wal(deadline) != "wal":
                raise sqlite3.OperationalError(f"{self.path}: cannot switch the database to WAL mode")
            # With WAL, NORMAL syncs at checkpoints rather than every commit: a crash may lose the last few
            # entries, never corrupt the file; fine for a cache.
            self._db.execute("PRAGMA synchronous=NORMAL")
        if not self._write(lambda db: [db.execute(statement) for statement in _SCHEMA]):
            raise sqlite3.OperationalError(f"{self.path}: cannot create the translation memory's tables")

    def _switch_to_wal(self, deadline: float) -> str:
        # Switching a new file to WAL needs the file to itself: while another process opens it too (replicas
        # starting together) it can fail with "database is locked" despite the busy timeout. Retry until then.
        while True:
            try:
                return self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower()
            except sqlite3.OperationalError as error:
                if not _is_locked(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def get(self, key: str) -> list[StoredHypothesis] | None:
        """The hypotheses stored under `key`, or None. A hit makes the entry the most recently used."""
        return self.get_many([key]).get(key)

    def get_many(self, keys: list[str]) -> dict[str, list[StoredHypothesis]]:
        """The stored hypotheses of those `keys` that are present (one query); hits are refreshed together."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        try:
            with self._lock:
                # Read as bytes, so that a value that is not valid UTF-8 is a corrupt entry, not an error.
                rows = self._db.execute("SELECT key, CAST(value AS BLOB) FROM entries "
                                        "WHERE key IN (SELECT value FROM json_each(?))",
                                        (json.dumps(wanted),)).fetchall()
        except sqlite3.Error as error:
            log.warning("translation memory read failed, treated as a miss: %s", error)
            rows = []
        found: dict[str, list[StoredHypothesis]] = {}
        corrupt: list[str] = []
        for key, raw in rows:
            hypotheses = _decode(raw)
            if hypotheses is None:
                corrupt.append(key)
            else:
                found[key] = hypotheses
        hits = sum(key in found for key in keys)  # each sentence asked for: one that occurs twice counts twice
        with self._lock:
            self.hits += hits
            self.misses += len(keys) - hits
        if corrupt:
            log.warning("translation memory: %d unreadable entries deleted", len(corrupt))
        if found or corrupt:
            # A lost refresh only makes eviction a little less exact: one attempt, no retries on a read.
            self._write(lambda db: self._refresh(db, list(found), corrupt), attempts=1)
        return found

    def put(self, key: str, hypotheses: list[StoredHypothesis]) -> None:
        self.put_many({key: hypotheses})

    def put_many(self, items: dict[str, list[StoredHypothesis]]) -> None:
        """Store all `items` in one transaction, then evict beyond the bound. A failed write is dropped."""
        try:
            # No hypotheses is no translation: nothing to answer a repeat with.
            rows = [(key, _encode(hypotheses)) for key, hypotheses in items.items() if hypotheses]
        except (TypeError, ValueError) as error:
            log.warning("translation memory write dropped, hypotheses not storable: %s", error)
            return
        if rows:
            self._write(lambda db: self._store(db, rows), attempts=WRITE_ATTEMPTS)

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT n FROM entry_count").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Recency is a counter kept in the database: MAX(used) + 1, read inside a BEGIN IMMEDIATE transaction.
    # That transaction holds the database's single write lock, so across all processes each write sees every
    # earlier commit and stamps a larger value: recency follows commit order. time.time_ns() would not: it is
    # read before the lock is taken (a process may stamp an earlier time yet commit later), and the wall
    # clock may step backwards (NTP), making a fresh entry look old. IMMEDIATE also matters under WAL: a
    # deferred transaction that reads, then writes after another process committed, fails at once, without
    # waiting on the busy timeout.
    @staticmethod
    def _next_used(db: sqlite3.Connection) -> int:
        return db.execute("SELECT COALESCE(MAX(used), 0) + 1 FROM entries").fetchone()[0]

    def _store(self, db: sqlite3.Connection, rows: list[tuple[str, str]]) -> None:
        first = self._next_used(db)
        # An upsert, not INSERT OR REPLACE: REPLACE deletes without firing the delete trigger (count drifts).
        db.executemany("INSERT INTO entries (key, value, used) VALUES (?, ?, ?) "
                       "ON CONFLICT (key) DO UPDATE SET value = excluded.value, used = excluded.used",
                       [(key, value, first + i) for i, (key, value) in enumerate(rows)])
        excess = db.execute("SELECT n FROM entry_count").fetchone()[0] - self.max_entries
        if excess > 0:
            db.execute("DELETE FROM entries WHERE key IN (SELECT key FROM entries ORDER BY used LIMIT ?)",
                       (excess,))

    def _refresh(self, db: sqlite3.Connection, hit_keys: list[str], corrupt_keys: list[str]) -> None:
        if hit_keys:
            db.execute("UPDATE entries SET used = ? WHERE key IN (SELECT value FROM json_each(?))",
                       (self._next_used(db), json.dumps(hit_keys)))
        if corrupt_keys:
            db.execute("DELETE FROM entries WHERE key IN (SELECT value FROM json_each(?))",
                       (json.dumps(corrupt_keys),))

    def _write(self, change: Callable[[sqlite3.Connection], object], attempts: int = WRITE_ATTEMPTS) -> bool:
        """Run `change` in a write transaction, retrying a locked database; False where it was dropped."""
        for attempt in range(1, attempts + 1):
            try:
                with self._lock:
                    self._db.execute("BEGIN IMMEDIATE")
                    try:
                        change(self._db)
                        self._db.execute("COMMIT")
                        return True
                    except BaseException:
                        if self._db.in_transaction:  # some errors end the transaction themselves
                            self._db.execute("ROLLBACK")
                        raise
            except sqlite3.Error as error:
                if not _is_locked(error):
                    log.warning("translation memory write dropped: %s", error)
                    return False
                if attempt == attempts:
                    log.warning("translation memory write dropped, database still locked after %d tries: %s",
                                attempts, error)
                    return False
                time.sleep(0.05 * attempt)  # outside the lock: other threads go on meanwhile
        return False


_SHARED: dict[str, TranslationMemory] = {}
_SHARED_LOCK = threading.Lock()


def shared_memory(path: str | None, max_entries: int) -> TranslationMemory | None:
    """The process's memory at `path` (None: the in-memory one), which every translator of the process shares;
    None when `max_entries` is 0 (no memory)."""
    if max_entries <= 0:
        return None
    where = str(pathlib.Path(path).resolve()) if path else ":memory:"
    with _SHARED_LOCK:
        memory = _SHARED.get(where)
        if memory is None or memory.max_entries != max_entries:
            memory = _SHARED[where] = TranslationMemory(path, max_entries)
        return memory
