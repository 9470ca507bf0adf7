"""Planted bugs of streaming detokenization (`tserve/model/detokenizer.py`); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

TESTS = "tests/model/test_tokenizer.py::"
HOLD = "            end = end - 1 if self._tok.decodes_bytes_lossily else len(prefix_text)"

TOKENIZER_BUGS = [
    Bug("byte-level-stream-holds-back-every-broken-byte", "tserve/model/detokenizer.py", HOLD,
        "            end = len(prefix_text)",
        (f"{TESTS}test_bytes_that_never_form_utf8_still_stream_at_a_bounded_cost",)),
    Bug("byte-level-stream-sends-an-unfinished-character", "tserve/model/detokenizer.py", HOLD,
        "            end = end if self._tok.decodes_bytes_lossily else len(prefix_text)",
        (f"{TESTS}test_byte_level_streams_hold_back_only_a_character_that_can_still_finish",)),
    Bug("held-window-never-moves", "tserve/model/detokenizer.py",
        "        if last - self._read >= 8 and", "        if False and",
        (f"{TESTS}test_bytes_that_never_form_utf8_still_stream_at_a_bounded_cost",)),
    Bug("byte-fallback-run-sent-piece-by-piece", "tserve/model/tokenizer.py",
        "        return False\n\n    @property\n    def special_ids", "        return True\n\n    @property\n    def special_ids",
        (f"{TESTS}test_sentencepiece_byte_fallback_holds_back_the_whole_broken_run",)),
    Bug("library-stream-fed-a-config-declared-special", "tserve/model/detokenizer.py",
        "        if token_id in self._unfed:", "        if False:",
        (f"{TESTS}test_the_libraries_stream_sends_what_the_window_decodes_send",)),
    Bug("library-streams-silence-taken-for-nothing-to-send", "tserve/model/detokenizer.py",
        "            delta = self._delta(force=False)\n            if delta:", "            delta = ''\n            if delta:",
        (f"{TESTS}test_the_libraries_stream_sends_what_the_window_decodes_send",)),
    Bug("library-stream-kept-after-the-window-decodes-sent-without-it", "tserve/model/detokenizer.py",
        "            if delta:\n                self._step = None", "            if delta:\n                pass",
        (f"{TESTS}test_the_libraries_stream_sends_what_the_window_decodes_send",)),
    Bug("library-stream-never-started-again", "tserve/model/detokenizer.py",
        "            if self._stream_of is not None and self._read", "            if False and self._read",
        (f"{TESTS}test_the_libraries_stream_sends_what_the_window_decodes_send",)),
    Bug("library-stream-started-again-with-text-still-held", "tserve/model/detokenizer.py",
        "self._read == len(self._ids):\n                self._step", "True:\n                self._step",
        (f"{TESTS}test_the_libraries_stream_sends_what_the_window_decodes_send",)),
]
