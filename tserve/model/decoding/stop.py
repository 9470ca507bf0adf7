"""Stop strings in streamed text."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Finds stop strings in streamed text. `feed(delta)` returns the text that is safe to emit (it can
    no longer become part of a stop string) and whether a stop string was hit; the stop string itself
    and anything after it are never emitted. `unchecked`: the deltas of that many first feeds (a request's first
    `min_tokens` tokens, one feed a token) pass unsearched: a stop string ends a text only once `min_tokens` tokens
    are out, as in vLLM, where `min_tokens` holds back eos and stop strings alike."""

    def __init__(self, stops: Sequence[str], unchecked: int = 0) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self._unchecked = unchecked

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if self._unchecked > 0:
            self._unchecked -= 1
            return delta, False
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)], True
        keep = 0  # longest suffix of `text` that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def close(self, tail: str) -> tuple[str, bool]:
        """The end of the stream: `tail` (what the detokenizer still held) is checked like any delta, then
        what was held back is let go. Returns (text, whether a stop string was hit)."""
        text, stopped = self.feed(tail)
        return text + self.flush(), stopped

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
