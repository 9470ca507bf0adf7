"""Planted bugs of the logits pipeline's bans (`tserve/model/decoding/logits.py`); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

HANDED_OVER = "tests/model/test_top_tokens.py::test_bans_write_into_the_scores_only_where_they_are_handed_over"

LOGITS_BUGS = [
    Bug("every-rows-eos-ban-writes-into-the-callers-scores", "tserve/model/decoding/logits.py",
        "            fill = scores.index_fill_ if owned else scores.index_fill", "            fill = scores.index_fill_",
        (f"{HANDED_OVER}[every-row]",)),
    Bug("one-rows-eos-ban-writes-into-the-callers-scores", "tserve/model/decoding/logits.py",
        "        put = scores.index_put_ if owned else scores.index_put", "        put = scores.index_put_",
        (f"{HANDED_OVER}[one-row]",)),
    Bug("inference-logits-written-outside-inference-mode", "tserve/model/decoding/logits.py",
        "        owned = owned and (torch.is_inference_mode_enabled() or not scores.is_inference())", "        pass",
        (f"{HANDED_OVER}[every-row]", f"{HANDED_OVER}[one-row]",
         "tests/engine/test_draft_model.py::test_the_draft_cache_holds_exactly_each_sequences_tokens")),
]
