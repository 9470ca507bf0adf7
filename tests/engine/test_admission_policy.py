"""The admission policy (`service/engine/admission.py`) on its own: plain requests, no engine, no thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from tserve.service.engine.admission import admission_order, queue_refusal, takes_reserved_rows


@dataclass(eq=False)
class Waiting:
    name: str
    client: object = None
    priority: int = 0
    turn: int = 0
    rows: int = 1
    group: object = field(default_factory=object)


def names(reqs: list[Waiting]) -> list[str]:
    return [r.name for r in reqs]


def test_max_queue_counts_client_requests_and_a_documents_parts_once() -> None:
    document = object()
    parts = [Waiting(f"part{i}", group=document, turn=i) for i in range(3)]
    other = Waiting("other")
    assert queue_refusal(Waiting("new"), parts, max_queue=2, free_rows=0, rows=lambda r: r.rows) is None
    assert queue_refusal(Waiting("part3", group=document, turn=3), [*parts, other], 2, 0, lambda r: r.rows) is None
    assert queue_refusal(Waiting("new"), [*parts, other], 2, 0, lambda r: r.rows) == "has 2 requests waiting"


def test_max_queue_0_takes_what_the_rows_left_by_the_waiting_take() -> None:
    rows = lambda r: r.rows  # noqa: E731
    assert queue_refusal(Waiting("a", rows=2), [], max_queue=0, free_rows=2, rows=rows) is None
    assert queue_refusal(Waiting("a", rows=3), [], 0, 2, rows) == "has no free rows and no waiting room"
    assert queue_refusal(Waiting("b"), [Waiting("a", rows=2)], 0, 3, rows) is None
    assert queue_refusal(Waiting("b", rows=2), [Waiting("a", rows=2)], 0, 3, rows) is not None
    call_job = Waiting("call", rows=0)  # holds no rows: taken even when none is free
    assert queue_refusal(call_job, [Waiting("a", rows=2)], 0, 1, rows) is None


def test_lower_priority_values_go_first_request_by_request() -> None:
    waiting = [Waiting("low", "a", priority=5), Waiting("urgent", "b", priority=-1), Waiting("mid", "a", priority=0),
               Waiting("b-mid", "b", priority=0)]
    # one client's requests each by its own priority, not all by the client's most urgent one
    assert names(admission_order(waiting, {})) == ["urgent", "mid", "b-mid", "low"]


def test_clients_take_turns_the_one_admitted_longest_ago_first() -> None:
    waiting = [Waiting(f"a{i}", "a") for i in range(3)] + [Waiting("b0", "b"), Waiting("c0", "c"), Waiting("b1", "b")]
    assert names(admission_order(waiting, {})) == ["a0", "b0", "c0", "a1", "b1", "a2"]
    # a admitted most recently, c never: c first, then b, then a
    assert names(admission_order(waiting, {"a": 7, "b": 3})) == ["c0", "b0", "a0", "b1", "a1", "a2"]


def test_a_clients_requests_go_by_turn_then_arrival() -> None:
    doc = object()
    waiting = [Waiting("doc2", "a", turn=2, group=doc), Waiting("doc0", "a", turn=0, group=doc),
               Waiting("short", "a"), Waiting("doc1", "a", turn=1, group=doc)]
    assert names(admission_order(waiting, {})) == ["doc0", "short", "doc1", "doc2"]


def test_reserved_rows_hold_back_only_a_client_that_already_holds_rows() -> None:
    assert takes_reserved_rows(needed=1, free_rows=2, reserved_rows=1, client_holds_rows=True) is False
    assert takes_reserved_rows(needed=2, free_rows=2, reserved_rows=1, client_holds_rows=True) is True
    assert takes_reserved_rows(needed=2, free_rows=2, reserved_rows=1, client_holds_rows=False) is False
    assert takes_reserved_rows(needed=2, free_rows=2, reserved_rows=0, client_holds_rows=True) is False


def test_a_client_never_admitted_goes_before_one_admitted_first_of_all() -> None:
    # the worker counts admissions from 1: a client admitted once has 1, one never admitted has none
    waiting = [Waiting("a1", "a"), Waiting("c0", "c")]
    assert names(admission_order(waiting, {"a": 1})) == ["c0", "a1"]
