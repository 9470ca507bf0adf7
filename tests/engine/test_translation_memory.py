"""The translation memory (tserve/service/translation/memory.py): keys that tell translations apart, LRU bound,
persistence across a restart, two processes on one file, corrupt values and locked writes as misses and
dropped writes, counters, and threads sharing one instance."""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import threading
import time
import traceback
from contextlib import closing

import pytest

from tserve.service.translation.memory import StoredHypothesis, TranslationMemory, memory_key, weights_hash

LOGGER = "tserve.translation_memory"


def _hypotheses(tag: str) -> list[StoredHypothesis]:
    return [StoredHypothesis(f"translation of {tag}", [len(tag), 7, 2], -0.25),
            StoredHypothesis(f"another translation of {tag}", [3, 1], -1.5)]


def _key(source: str, **changes) -> str:
    """The key of a sentence whose source ids are its characters' code points (a tokenizer that normalises
    nothing)."""
    parts = {"model": "mt", "weights_hash": "abc123", "source_lang": "en", "target_lang": "de",
             "options": {"num_beams": 4, "max_tokens": 64, "n": 1}, "source_ids": [ord(c) for c in source]}
    return memory_key(**{**parts, **changes})


def release_lock_on_sleep(monkeypatch, other_process: sqlite3.Connection) -> None:
    """The other process's transaction ends the first time the memory sleeps before a retry."""
    sleep = time.sleep

    def release_then_sleep(seconds: float) -> None:
        if other_process.in_transaction:
            other_process.execute("ROLLBACK")
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", release_then_sleep)


def test_round_trip_and_every_part_of_the_key_tells_translations_apart():
    memory = TranslationMemory(None, max_entries=100)
    key = _key("Hello world.")
    memory.put(key, _hypotheses("hello"))
    assert memory.get(key) == _hypotheses("hello")
    assert isinstance(memory.get(key)[0].score, float)

    others = [_key("Hello world.", model="mt2"), _key("Hello world.", weights_hash="abc124"),
              _key("Hello world.", source_lang="fr"), _key("Hello world.", target_lang="fr"),
              _key("Hello world.", source_lang=None), _key("Hello world.", target_lang=None),
              _key("Hello world.", options={"num_beams": 5, "max_tokens": 64, "n": 1}),
              _key("Hello world.",
                   options={"num_beams": 4, "max_tokens": 64, "n": 1, "glossary": {"world": "Welt"}}),
              _key("Hello world!")]
    assert len(set(others)) == len(others) and key not in others
    assert all(memory.get(other) is None for other in others)

    # The sentence is what the model reads: other ids (another space, a decomposed é) are another sentence,
    # the same ids (however they were spelled) the same one.
    assert _key("  Hello \t world.\n") != key and _key("Hello\u00a0world.") != key
    assert _key("Caf\u00e9 au lait") != _key("Cafe\u0301 au lait")
    assert memory_key("mt", "abc123", "en", "de", {"num_beams": 4, "max_tokens": 64, "n": 1},
                      [ord(c) for c in "Hello world."]) == key
    assert _key("Hello world.", options={"n": 1, "max_tokens": 64, "num_beams": 4}) == key  # option order
    with pytest.raises(TypeError):
        _key("Hello world.", options={"constraint": object()})


def test_weights_hash_follows_names_sizes_and_bytes_not_the_order_given(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"\x00" * 3_000_000)  # over one 1 MiB read
    (tmp_path / "b.json").write_bytes(b'{"dim": 8}')
    files = [tmp_path / "a.safetensors", tmp_path / "b.json"]
    original = weights_hash(files)
    assert weights_hash(list(reversed(files))) == original
    (tmp_path / "a.safetensors").write_bytes(b"\x00" * 2_999_999 + b"\x01")
    changed = weights_hash(files)
    assert changed != original
    (tmp_path / "b.json").rename(tmp_path / "c.json")
    assert weights_hash([tmp_path / "a.safetensors", tmp_path / "c.json"]) != changed


def test_entries_survive_a_restart(tmp_path):
    path = tmp_path / "memory.sqlite"
    memory = TranslationMemory(path, max_entries=100)
    memory.put_many({_key("one"): _hypotheses("one"), _key("two"): _hypotheses("two")})
    memory.close()

    reopened = TranslationMemory(path, max_entries=100)
    assert reopened.get(_key("one")) == _hypotheses("one")
    assert reopened.get(_key("two")) == _hypotheses("two")
    assert len(reopened) == 2
    reopened.close()


def test_least_recently_used_entry_goes_first_a_get_counting_as_a_use(tmp_path):
    memory = TranslationMemory(tmp_path / "memory.sqlite", max_entries=3)
    for name in "abc":
        memory.put(name, _hypotheses(name))
    assert memory.get("a") == _hypotheses("a")
    memory.put("d", _hypotheses("d"))
    assert memory.get("b") is None
    assert memory.get_many(["a", "c", "d"]) == {name: _hypotheses(name) for name in "acd"}
    assert len(memory) == 3

    # get_many refreshes its hits too: after it, "c" and "d" are newer than "a".
    memory.get_many(["c", "d"])
    memory.put("e", _hypotheses("e"))
    assert memory.get("a") is None
    assert len(memory) == 3


def test_putting_a_key_again_replaces_its_value_and_does_not_grow_the_count():
    memory = TranslationMemory(None, max_entries=3)
    for name in "abc":
        memory.put(name, _hypotheses(name))
    memory.put("a", _hypotheses("new a"))
    memory.put("b", _hypotheses("new b"))
    assert len(memory) == 3
    assert memory.get_many(["a", "b", "c"]) == {"a": _hypotheses("new a"), "b": _hypotheses("new b"),
                                                "c": _hypotheses("c")}


def test_in_memory_mode_works_and_is_bounded():
    memory = TranslationMemory(None, max_entries=2)
    memory.put_many({name: _hypotheses(name) for name in "abcde"})
    assert len(memory) == 2
    # Within one put_many, later items count as more recent, whichever were stored first.
    assert memory.get_many(list("abcde")) == {"d": _hypotheses("d"), "e": _hypotheses("e")}
    memory.put_many({"e": _hypotheses("e"), "d": _hypotheses("d"), "c": _hypotheses("c")})
    assert memory.get_many(list("cde")) == {"d": _hypotheses("d"), "c": _hypotheses("c")}
    for name in "fgh":
        memory.put(name, _hypotheses(name))
    assert len(memory) == 2
    assert memory.get_many(list("fgh")) == {"g": _hypotheses("g"), "h": _hypotheses("h")}
    assert len(TranslationMemory(None, max_entries=2)) == 0  # each in-memory instance is its own database
    with pytest.raises(ValueError):
        TranslationMemory(None, max_entries=0)


ENTRIES_PER_PROCESS = 300


def _process_key(writer: str, index: int) -> str:
    return f"{writer}-{index}"


def _check_the_others(memory: TranslationMemory, other: str) -> set[str]:
    found = memory.get_many([_process_key(other, i) for i in range(ENTRIES_PER_PROCESS)])
    assert all(hypotheses == _hypotheses(key) for key, hypotheses in found.items())
    return set(found)


def _share_one_file(path: str, writer: str, reader_of: str, start: multiprocessing.synchronize.Barrier,
                    done_writing: dict[str, multiprocessing.synchronize.Event],
                    results: multiprocessing.queues.Queue) -> None:
    """Puts this writer's entries (alone and in batches), reading each back at once and the other writer's
    as they appear; once both are done, checks it sees all of the other's. Reports a traceback, or None."""
    try:
        memory = TranslationMemory(path, max_entries=100_000)
        start.wait(timeout=60)
        seen_of_other = set()
        for first in range(0, ENTRIES_PER_PROCESS, 5):
            keys = [_process_key(writer, i) for i in range(first, first + 5)]
            batch = {key: _hypotheses(key) for key in keys}
            if first % 10:
                memory.put_many(batch)
            else:
                for key, hypotheses in batch.items():
                    memory.put(key, hypotheses)
            assert memory.get_many(list(batch)) == batch
            assert all(memory.get(key) == hypotheses for key, hypotheses in batch.items())
            seen_of_other.update(_check_the_others(memory, reader_of))
        done_writing[writer].set()
        deadline = time.monotonic() + 120
        while not done_writing[reader_of].wait(timeout=0.01) and time.monotonic() < deadline:
            seen_of_other.update(_check_the_others(memory, reader_of))
        seen_of_other.update(_check_the_others(memory, reader_of))
        assert len(seen_of_other) == ENTRIES_PER_PROCESS, f"saw {len(seen_of_other)} of the other's entries"
        memory.close()
        results.put((writer, None))
    except BaseException:
        results.put((writer, traceback.format_exc()))
    finally:
        done_writing[writer].set()  # the other stops waiting for this one, whatever happened


def test_two_processes_write_and_read_one_file_at_once(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    done_writing = {"first": context.Event(), "second": context.Event()}
    processes = [context.Process(target=_share_one_file,
                                 args=(path, writer, other, start, done_writing, results))
                 for writer, other in (("first", "second"), ("second", "first"))]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=180) for _ in processes]
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    for writer, error in reports:
        assert error is None, f"{writer}:\n{error}"

    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    memory = TranslationMemory(path, max_entries=100_000)
    every_key = [_process_key(writer, i) for writer in ("first", "second")
                 for i in range(ENTRIES_PER_PROCESS)]
    assert memory.get_many(every_key) == {key: _hypotheses(key) for key in every_key}
    assert len(memory) == 2 * ENTRIES_PER_PROCESS
    memory.close()


@pytest.mark.parametrize("garbage", ["not json", b"\xff\xfe\x00", 42, "{}", "[]", "[1]", '[{"text": "x"}]',
                                     '[{"text": "x", "token_ids": [1.5], "score": 0}]',
                                     '[{"text": 3, "token_ids": [1], "score": 0}]',
                                     '[{"text": "x", "token_ids": [1], "score": "high"}]'])
def test_a_corrupt_stored_value_is_a_miss_and_is_deleted(tmp_path, garbage, caplog):
    path = tmp_path / "memory.sqlite"
    memory = TranslationMemory(path, max_entries=10)
    memory.put_many({"bad": _hypotheses("bad"), "good": _hypotheses("good")})
    with closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE entries SET value = ? WHERE key = 'bad'", (garbage,))
        db.commit()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert memory.get("bad") is None
    assert "unreadable" in caplog.text
    assert memory.get_many(["bad", "good"]) == {"good": _hypotheses("good")}
    assert len(memory) == 1  # deleted, so the next put stores a good value again
    assert memory.misses == 2
    memory.close()


def test_a_write_locked_out_is_retried_then_dropped_with_a_warning(tmp_path, caplog, monkeypatch):
    path = tmp_path / "memory.sqlite"
    memory = TranslationMemory(path, max_entries=10, busy_timeout_s=0.05)
    other_process = sqlite3.connect(path, isolation_level=None)
    other_process.execute("BEGIN IMMEDIATE")  # holds the write lock

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        memory.put("a", _hypotheses("a"))  # no exception: the write is dropped
    assert "still locked" in caplog.text
    assert memory.get("a") is None

    # The lock goes away while the memory waits to retry: the retry stores the entry.
    release_lock_on_sleep(monkeypatch, other_process)
    memory.put("b", _hypotheses("b"))
    monkeypatch.undo()
    assert memory.get("b") == _hypotheses("b")
    other_process.close()
    memory.close()


def test_hits_and_misses_are_counted():
    memory = TranslationMemory(None, max_entries=10)
    assert (memory.hits, memory.misses) == (0, 0)
    assert memory.get("a") is None
    memory.put("a", _hypotheses("a"))
    memory.put("b", _hypotheses("b"))
    assert memory.get("a") is not None
    assert (memory.hits, memory.misses) == (1, 1)
    memory.get_many(["a", "b", "c", "d", "c", "a"])
    assert (memory.hits, memory.misses) == (4, 4)  # per key asked for: "a" twice two hits, "c" twice two misses


def test_threads_share_one_in_memory_instance(caplog):
    memory = TranslationMemory(None, max_entries=100_000)
    errors: list[str] = []

    def work(thread: int) -> None:
        try:
            for i in range(150):
                key = f"{thread}-{i}"
                memory.put(key, _hypotheses(key))
                assert memory.get(key) == _hypotheses(key), key
                if i % 10 == 0:
                    batch = {f"{thread}-{i}-{j}": _hypotheses(f"{thread}-{i}-{j}") for j in range(3)}
                    memory.put_many(batch)
                    assert memory.get_many(list(batch)) == batch
        except BaseException:
            errors.append(traceback.format_exc())

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        threads = [threading.Thread(target=work, args=(thread,)) for thread in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors[0]
    assert not caplog.records, caplog.text  # no write was dropped
    assert len(memory) == 4 * (150 + 15 * 3)
    assert memory.misses == 0


def test_opening_a_new_file_another_process_holds_waits_for_it_and_switches_to_wal(tmp_path, monkeypatch):
    """Replicas starting together: switching a new file to WAL fails while another connection reads it."""
    path = tmp_path / "memory.sqlite"
    other_process = sqlite3.connect(path, isolation_level=None)
    other_process.execute("CREATE TABLE unrelated (x)")
    other_process.execute("BEGIN")
    other_process.execute("SELECT * FROM unrelated").fetchall()  # a read transaction, still open
    release_lock_on_sleep(monkeypatch, other_process)
    memory = TranslationMemory(path, max_entries=10, busy_timeout_s=0.05)
    monkeypatch.undo()
    memory.put("a", _hypotheses("a"))
    assert memory.get("a") == _hypotheses("a")
    memory.close()
    other_process.close()
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_memory_of_one_entry_keeps_the_latest():
    memory = TranslationMemory(None, max_entries=1)
    memory.put("a", _hypotheses("a"))
    memory.put("b", _hypotheses("b"))
    assert len(memory) == 1 and memory.get_many(["a", "b"]) == {"b": _hypotheses("b")}
    with pytest.raises(ValueError, match="max_entries must be at least 1, not 0"):
        TranslationMemory(None, max_entries=0)


def test_a_write_that_fails_otherwise_than_locked_is_dropped_at_once_with_its_reason(caplog):
    memory = TranslationMemory(None, max_entries=4)
    memory._db.execute("DROP TABLE entries")  # every later write fails: no such table
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        memory.put("a", _hypotheses("a"))
    assert [r.getMessage() for r in caplog.records] == ["translation memory write dropped: no such table: entries"]
