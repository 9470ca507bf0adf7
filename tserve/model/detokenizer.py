"""Streaming text from generated ids: the text each new id completes, for streamed responses."""

from __future__ import annotations

from collections.abc import Callable

from tserve.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas for streaming responses.

    Decoding token by token is wrong twice over: a character may span several byte-level tokens,
    and SentencePiece decoders drop a word's leading space at the start of a sequence. So, as vLLM
    and TGI do, each push decodes a short window twice (``[prefix:read]`` and ``[prefix:]``), emits
    only the difference, and holds text back while it ends in U+FFFD (an unfinished character). A
    byte-level decoder's text holds back its last U+FFFD only (the ones before it are bytes no later
    byte completes; llama.cpp's server sends them too), so that a model emitting bytes that never form
    UTF-8 still streams. Without ``prompt_ids`` the pushes plus ``flush()`` concatenate to
    ``tokenizer.decode(generated)``; with them, the window starts inside the prompt, so the first word
    keeps its leading space, as a continuation of the prompt text should.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids or []]
        self._read = len(self._ids)
        self._prefix = max(self._read - 5, 0)  # a few prompt tokens of context, as vLLM uses
        self._sent = 0  # characters of the window's text past [prefix:read]'s already emitted
        self._text = ""
        # The tokenizer library's own stream, where it has one, keeps the same window and emits the same text
        # while that text ends in a whole character (a token's usual case) for a fraction of two decodes; the
        # window's ids are then kept in step with it. When it emits nothing the decodes here decide (a byte-level
        # text emits all but its last U+FFFD, which the library holds back); once they emit where it did not (or
        # it refuses a window whose text changed before its end) the stream is dropped, and a new one starts
        # when the window has sent all its text again.
        self._stream_of = getattr(tokenizer, "decode_stream", None)
        self._step = self._new_stream()
        if self._step is None:  # none in this tokenizer's library: the two decodes throughout, never asked again
            self._stream_of = None
        self._unfed = tokenizer.special_ids if self._step is not None and skip_special_tokens else frozenset()

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def _delta(self, force: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        end = len(new_text)
        if new_text.endswith("\ufffd") and not force:
            end = end - 1 if self._tok.decodes_bytes_lossily else len(prefix_text)
        start = len(prefix_text) + self._sent
        if end <= start:
            return ""
        delta = new_text[start:end]
        self._text += delta
        if end == len(new_text):
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        else:
            self._sent = end - len(prefix_text)
            self._move_held_window(new_text[len(prefix_text) : end])
        return delta

    def _move_held_window(self, emitted: str) -> None:
        """A window whose text keeps ending in U+FFFD (bytes that never form UTF-8) would grow with every id:
        once it holds a few, it starts again before its last id where the ids before that decode to exactly
        the text emitted for them (the last id begins a new broken sequence: nothing before it can change)."""
        last = len(self._ids) - 1
        if last - self._read >= 8 and self._tok.decode(self._ids[self._read : last], self._skip) == emitted:
            self._prefix, self._read, self._sent = self._read, last, 0

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a character or word is pending)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._step is None:
            delta = self._delta(force=False)
            if self._stream_of is not None and self._read == len(self._ids):
                self._step = self._new_stream()  # every id's text is out: the library's state is a new stream's
            return delta
        if token_id in self._unfed:  # no text of its own: the window's text is unchanged
            return ""
        try:
            delta = self._step(token_id)
        except Exception:  # tokenizers' DecodeStreamError: the window's text no longer starts with its prefix's
            self._step = None
            return self._delta(force=False)
        if delta is None:
            delta = self._delta(force=False)
            if delta:
                self._step = None
            return delta
        self._text += delta
        self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        return delta

    def _new_stream(self) -> Callable[[int], str | None] | None:
        return self._stream_of(self._ids[self._prefix : self._read], self._skip) if self._stream_of else None

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a trailing incomplete character) at the end."""
        self._step = None
        return self._delta(force=True)
