"""A step's chosen tokens on their way from the device to the host. An engine that schedules asynchronously
launches the next step, which feeds these very tokens from the device, before it reads them (`result`); until
then each sequence of the step counts the token as `unresolved` and knows where it is (`fed_from`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tserve.model.device_inputs import to_device


class ChosenTokens:
    """A step's chosen tokens (and the logprobs asked for) on the device, copied to the host without waiting:
    an engine launches the next step, which feeds these very tokens from the device, before it reads them here
    (`result`). Until then each of its sequences counts the token as `unresolved`."""

    def __init__(self, seqs: Sequence[Any], tokens: Tensor, logprobs: tuple[Tensor, ...] | None) -> None:
        """`seqs`: the step's sequences, row by row (each has `unresolved` and `fed_from`); `tokens` (rows,) on
        the device; `logprobs`: tensors (rows, ...) that come back with them."""
        self.seqs, self.tokens = list(seqs), tokens
        self._ready: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = [_pinned_copy(t) for t in (tokens, *(logprobs or ()))]
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = [tokens, *(logprobs or ())]
        self._result: tuple[list[int], tuple | None] | None = None
        for row, seq in enumerate(self.seqs):
            seq.unresolved += 1
            seq.fed_from = (self, row)

    def result(self) -> tuple[list[int], tuple | None]:
        """Every row's token and the logprobs' lists (None without them), once the device has them."""
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            tokens, *logprobs = (t.tolist() for t in self._host)
            self._result = tokens, (tuple(logprobs) if logprobs else None)
        return self._result


    def read(self) -> tuple[list[int], tuple | None]:
        """`result`; each sequence counts the token unresolved no longer, and its next step feeds from the host
        unless a later step's token of it is on its way."""
        result = self.result()
        for seq in self.seqs:
            seq.unresolved -= 1
            if seq.fed_from is not None and seq.fed_from[0] is self:
                seq.fed_from = None
        return result


def feed_tokens(known: list[int], from_device: list[tuple[int, ChosenTokens, int]], device: torch.device) -> Tensor:
    """A step's input tokens on `device`: `known` (host ints), where each (i, step, row) of `from_device` puts
    row `row` of an earlier step's chosen tokens at place i instead, without the host reading them."""
    fed = to_device(known, device)
    by_step: dict[int, tuple[ChosenTokens, list[int], list[int]]] = {}
    for i, step, row in from_device:
        _, at, rows = by_step.setdefault(id(step), (step, [], []))
        at.append(i)
        rows.append(row)
    for step, at, rows in by_step.values():
        fed.index_copy_(0, to_device(at, device), step.tokens.index_select(0, to_device(rows, device)))
    return fed


def _pinned_copy(t: Tensor) -> Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
