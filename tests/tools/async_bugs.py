"""Planted bugs of asynchronous scheduling: a step fed stale tokens, a finished request's extra row reaching its
stream, a step taken past max_tokens, blocks never named, a preemption or a penalty that does not wait for the
tokens on their way, the overlap silently off; and the engine's per-token bookkeeping beside it (speculative
steps' logprobs, the acceptance gauge, the latency metrics) (part of `tests/tools/planted_bugs.py`'s list)."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

ASYNC = "tests/engine/test_async_scheduling.py::"
EVERY_OPTION = ASYNC + "test_every_option_streams_what_the_synchronous_engine_streams"
ROW_COUNTS = ASYNC + "test_a_request_ended_by_max_tokens_is_not_stepped_again_and_one_ended_by_eos_is_once"
PREEMPTION = ASYNC + "test_preemption_speculation_and_cancelled_clients_stream_what_the_synchronous_engine_streams"
FOLLOW_UP = ASYNC + "test_blocks_filled_by_tokens_fed_from_the_device_are_found_by_a_follow_up_prompt"
TRANSLATION = "tests/engine/test_async_translation.py::"
MT_STREAMS = TRANSLATION + "test_greedy_beams_glossary_and_preemption_stream_what_the_synchronous_engine_streams"
MT_ROWS = TRANSLATION + "test_a_greedy_row_ended_by_max_tokens_is_not_stepped_again_and_one_ended_by_eos_is_once"

ASYNC_BUGS = [
    Bug("async-step-feeds-the-last-token-read", "tserve/model/decoding/lm_runner.py",
        "        if not any(s.unresolved for s in seqs):", "        if True:",
        (EVERY_OPTION,)),
    Bug("async-finished-request-streams-its-extra-row", "tserve/service/engine/worker.py",
        "            live = [i for i, r in enumerate(chosen.seqs) if not r.finished]",
        "            live = list(range(len(chosen.seqs)))",
        (ROW_COUNTS,)),
    Bug("async-steps-past-max-tokens", "tserve/model/decoding/lm_runner.py",
        "        return seq.unresolved > 0 and (n >= seq.params.max_tokens", "        return False and (n >= seq.params.max_tokens",
        (ROW_COUNTS,)),
    Bug("async-blocks-fed-from-the-device-never-named", "tserve/model/decoding/lm_runner.py",
        "            if seq.table is not None and known // self.blocks.block_size > len(seq.table.hashes) and \\",
        "            if False and \\",
        (FOLLOW_UP,)),
    Bug("async-preempts-before-reading-the-tokens-on-their-way", "tserve/service/engine/generation.py",
        "                if self._in_flight:\n                    return None", "                if False:\n                    return None",
        (PREEMPTION,)),
    Bug("async-penalties-and-grammars-read-stale-tokens", "tserve/model/decoding/lm_runner.py",
        "        return seq.params.penalized or seq.grammar is not None", "        return False",
        (EVERY_OPTION,)),
    Bug("async-overlap-never-on", "tserve/service/engine/worker.py",
        '    return async_scheduling == "on" or', '    return False and',
        (EVERY_OPTION,)),
    Bug("async-translation-feeds-from-the-host", "tserve/model/decoding/seq2seq_runner.py",
        "            if s.greedy and s.unresolved and not s.replaying:", "            if False:",
        (MT_STREAMS,)),
    Bug("async-translation-steps-past-max-tokens", "tserve/model/decoding/seq2seq_runner.py",
        "        return seq.unresolved > 0 and len(seq.generated) + seq.unresolved >= seq.job.max_new_tokens",
        "        return False", (MT_ROWS,)),
    Bug("async-translation-logprobs-not-added", "tserve/service/engine/translation.py",
        "            req.logprob_sum += logprob", "            pass", (MT_STREAMS,)),
    Bug("step-latencies-observed-one-bucket-late", "tserve/service/metrics.py",
        "bisect.bisect_left(bounds, v)", "bisect.bisect_right(bounds, v)",
        ("tests/engine/test_worker_behaviour.py::test_a_steps_latencies_observed_at_once_fill_the_buckets_one_by_one_would",)),
    Bug("speculative-steps-drop-their-logprobs", "tserve/service/engine/generation.py",
        "                self._emit(req, token, lp, now)", "                self._emit(req, token, None, now)",
        ("tests/engine/test_speculative.py::"
         "test_every_sampling_and_stopping_option_gives_with_drafts_what_it_gives_without",)),
    Bug("acceptance-gauge-subtracts-the-kept-tokens", "tserve/service/engine/generation.py",
        "self._accepted + kept", "self._accepted - kept",
        ("tests/engine/test_speculative.py::"
         "test_every_sampling_and_stopping_option_gives_with_drafts_what_it_gives_without",)),
    Bug("first-token-taken-for-a-later-one", "tserve/service/engine/worker.py",
        "        if req.last_emit == 0.0:", "        if req.last_emit != 0.0:",
        ("tests/engine/test_paged_engine.py::test_each_request_counts_one_first_token_and_a_gap_before_each_later_one",)),
]
