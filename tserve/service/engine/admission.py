"""A worker's admission policy, as pure functions of what waits and what runs (no lock, thread or engine in
here; the `Worker` calls them under its lock and acts on the answers):

- whether the queue takes one more request (`queue_refusal`): --max-queue counts client requests (the parts of
  a document once); with --max-queue 0 there is no waiting room, and a request is taken only when the rows left
  by the running and the waiting requests take it;
- the order in which waiting requests are admitted (`admission_order`): lower priority values first; within a
  priority the clients in turn, the one admitted longest ago (or never) first, so that one client's flood does
  not hold another's request back by more than a turn; each client's own requests by turn (a document's k-th
  sentence behind every earlier part of its other requests), then in arrival order;
- whether a request would take rows kept for other clients (`takes_reserved_rows`, --reserved-rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar


class Waiting(Protocol):
    """What the policy reads of a request: whose it is and how urgent (`engine.request.Admission`), and which
    client request it is part of (`group`, its part `turn`)."""

    group: object
    turn: int
    priority: int
    client: object


W = TypeVar("W", bound=Waiting)


def queue_refusal(req: W, waiting: Iterable[W], max_queue: int, free_rows: int, rows: Callable[[W], int],
                  whole: int | None = None) -> str | None:
    """Why the queue refuses `req` (None: it takes it). `free_rows`: the rows no running request holds;
    `rows(r)`: the rows a request takes once admitted (0 for a call job, which holds none). `whole`: where a
    request's parts may run in turns (a batcher's items, over consecutive batches), every row: a request with more
    parts than that never fits at once, and with no waiting room it starts when all of them are free and nothing of
    another request waits."""
    if max_queue == 0:  # no waiting room: only what the free rows take at the next step
        waiting = list(waiting)
        needed, held = rows(req), sum(rows(r) for r in waiting)
        alone = whole is not None and free_rows == whole and req.group is not None and all(
            r.group is req.group for r in waiting)
        if needed and needed > free_rows - held and not (alone and held + needed > whole):
            return "has no free rows and no waiting room"
        return None
    groups = {r.group for r in waiting}
    if req.group not in groups and len(groups) >= max_queue:
        return f"has {len(groups)} requests waiting"
    return None


def admission_order(waiting: Iterable[W], last_admitted: Mapping[object, int]) -> list[W]:
    """The waiting requests in the order they are admitted (the module's docstring). `last_admitted`: each
    client's latest admission, as a count that grows with every admission."""
    queues: dict[tuple[int, object], list[W]] = {}
    for req in sorted(waiting, key=lambda r: r.turn):  # stable: arrival order within a turn
        queues.setdefault((req.priority, req.client), []).append(req)
    order: list[W] = []
    for priority in sorted({p for p, _ in queues}):
        clients = sorted((q for q in queues if q[0] == priority), key=lambda q: last_admitted.get(q[1], -1))
        lanes = [list(reversed(queues[c])) for c in clients]
        while lanes:
            order += [lane.pop() for lane in lanes]
            lanes = [lane for lane in lanes if lane]
    return order


def takes_reserved_rows(needed: int, free_rows: int, reserved_rows: int, client_holds_rows: bool) -> bool:
    """Whether admitting a request of `needed` rows, while `free_rows` are free, would take rows reserved for
    other clients: only a client that already holds rows (running, or admitted in this step) is held to them."""
    return bool(reserved_rows) and client_holds_rows and free_rows - needed < reserved_rows
