"""Planted bugs of the logits pipeline's bans (`tserve/model/decoding/logits.py`); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

HANDED_OVER = "tests/model/test_top_tokens.py::test_bans_write_into_the_scores_only_where_they_are_handed_over"
EXCLUSIONS = "tests/model/test_generation.py::test_rows_whose_constraints_only_rule_ids_out_take_the_argmax_of_the_rest"
MIN_TOKENS = "tests/model/test_generation.py::test_generate_stops_and_respects_min_tokens"

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
    Bug("greedy-exclusions-forget-the-eos-ban", "tserve/model/decoding/logits.py",
        "return [self.banned + self.eos_ids if self._eos_banned(r) else self.banned for r in rows]",
        "return [self.banned for r in rows]",
        (EXCLUSIONS, MIN_TOKENS, "tests/engine/test_mutation_gaps.py::test_eos_min_tokens_and_ignore_eos_through_the_engine")),
    Bug("argmax-excluded-ids-left-in", "tserve/model/kernels/argmax_rows.cpp",
        "        written[m * n + id] = -std::numeric_limits<float>::infinity();", "        (void)written;",
        ("tests/model/test_argmax_rows.py::test_excluded_ids_are_written_minus_inf_and_never_chosen[float32]",
         EXCLUSIONS, MIN_TOKENS)),
]
