"""Planted bugs of the KV caches' bookkeeping: a translator's block pool sized by memory (decoder rows and encoded
sources), its preemption and replay (part of `tests/tools/planted_bugs.py`'s list)."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

PREEMPTION_TEST = "tests/engine/test_translation_preemption.py::test_preempted_requests_finish_as_alone"
KEPT_SOURCES_TEST = "tests/engine/test_translation_preemption.py::test_kept_encoder_outputs_give_their_blocks_up_the_oldest_first"
CROSS_TEST = "tests/model/test_models.py::test_cross_keys_and_values_live_in_their_slots_blocks_of_the_pool"

CACHE_BUGS = [
    Bug("translation-preempted-without-replay", "model/decoding/seq2seq_runner.py",
        "        seq.resume_at = seq.next_position", "        seq.resume_at = 0",
        (PREEMPTION_TEST,)),
    Bug("translation-replay-feeds-the-last-greedy-token", "model/decoding/seq2seq_runner.py",
        "tokens.append(s.generated[position - 1] if position else", "tokens.append(s.generated[-1] if s.generated else",
        (PREEMPTION_TEST,)),
    Bug("translation-replay-feeds-the-beams-last-tokens", "model/decoding/seq2seq_runner.py",
        "beam_tokens.append(s.search.tokens_at(position) if s.replaying else s.search.last_tokens)",
        "beam_tokens.append(s.search.last_tokens)",
        (PREEMPTION_TEST,)),
    Bug("translation-replay-feeds-the-constrained-beams-last-tokens", "model/decoding/constrained_beam.py",
        "return torch.tensor([b.tokens[position - 1] if 0 < position <= len(b.tokens) else self.start",
        "return torch.tensor([b.tokens[-1] if b.tokens else self.start",
        (PREEMPTION_TEST,)),
    Bug("translation-pool-ignores-the-memory-budget", "service/engine/translation.py",
        "reuse_sources=reuse_sources, num_blocks=num_blocks, block_size=kv_block_size)",
        "reuse_sources=reuse_sources, block_size=kv_block_size)",
        ("tests/engine/test_translation_preemption.py::test_the_pool_is_sized_by_memory",
         PREEMPTION_TEST)),
    Bug("translation-task-drops-the-kv-budget", "service/tasks/translation.py",
        "reuse_sources=s.prefix_cache, kv_cache_budget=s.kv_cache_budget,", "reuse_sources=s.prefix_cache,",
        ("tests/engine/test_translation_preemption.py::test_the_servers_settings_size_a_translators_pool",)),
    Bug("translation-request-larger-than-the-pool-admitted", "service/engine/translation.py",
        "        if self.runner.blocks_needed(job) > self.runner.blocks.num_usable:",
        "        if False:",
        ("tests/engine/test_translation_preemption.py::test_a_request_larger_than_the_pool_is_refused",)),
    Bug("kept-encoder-outputs-never-give-their-blocks-up", "model/decoding/seq2seq_runner.py",
        "        if self.blocks.num_free + kept < n:", "        if self.blocks.num_free < n:",
        (KEPT_SOURCES_TEST,)),
    Bug("the-newest-kept-encoder-output-gives-way-first", "model/decoding/seq2seq_runner.py",
        "for slot in [slot for slot in self._idle_slots if slot != keep]:",
        "for slot in reversed([slot for slot in self._idle_slots if slot != keep]):",
        (KEPT_SOURCES_TEST,)),
    Bug("admission-ignores-the-sources-blocks", "model/decoding/seq2seq_runner.py",
        "            need += self.blocks.blocks_for(len(seq.job.source_ids))", "            need += 0",
        (PREEMPTION_TEST,)),
    Bug("a-source-nobody-keeps-keeps-its-blocks", "model/decoding/seq2seq_runner.py",
        "                    self.blocks.release(self.source_tables.pop(slot))\n                    self.cross_slots",
        "                    self.source_tables.pop(slot)\n                    self.cross_slots",
        ("tests/engine/test_paged_engine.py::test_an_identical_source_reads_the_encoder_output_of_the_first",
         "tests/http/test_reliability.py::test_soak_mixed_load_with_disconnects")),
    Bug("cross-attention-reads-a-stale-copy-after-a-write", "model/kv_cache.py",
        "        self.lengths[slots] = lengths\n        self._last_read = None", "        self.lengths[slots] = lengths",
        (CROSS_TEST,)),
    Bug("cross-attention-reads-a-stale-copy-after-a-new-table", "model/kv_cache.py",
        "device=self.tables.device)\n        self._last_read = None", "device=self.tables.device)",
        (CROSS_TEST,)),
    Bug("sources-written-past-their-blocks", "model/kv_cache.py",
        "flat = (self.tables[slots][:, t // bs] * bs + t % bs).reshape(-1)",
        "flat = (self.tables[slots][:, :1] * bs + t).reshape(-1)",
        (CROSS_TEST,)),
    Bug("a-too-long-source-claims-blocks-first", "model/decoding/seq2seq_runner.py",
        "        if len(seq.job.source_ids) > self.max_source_len:  # (before anything is claimed)",
        "        if False:",
        ("tests/engine/test_translation_preemption.py::test_a_source_longer_than_the_runner_holds_claims_nothing",)),
]
