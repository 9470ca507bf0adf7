"""Planted bugs where two features meet in one request or one batch, the third survey: a fresh prompt prefilled
before rows that read a cached prefix, each with its own sampling options (`tests/engine/test_option_combinations_batched.py`);
speculative steps beside grammar and penalised rows, prefix caching and a draft model's padded output layer
(`tests/engine/test_option_combinations_speculative_pairs.py`); beams through HTML pages, files' blocks and pivots, a
glossary beside max_tokens and streaming (`tests/engine/test_option_combinations_translation_pairs.py`); streamed tool
calls beside several choices, logprobs, a response format and max_tokens (`tests/http/test_option_combinations_streaming_pairs.py`);
key and body priorities on every route, and a repository load whose client leaves
(`tests/http/test_option_combinations_operations_pairs.py`); the paged cache read back through a non-adjacent block,
padding past a row's table and the sliding layers' pool under drafts (`tests/model/test_option_combinations_model_pairs.py`);
and the module tests named. Part of `tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

from __future__ import annotations

from tests.tools.pair_bugs_more import PAIR_BUGS_MORE
from tests.tools.planted_bug import Bug

LOGITS = "tserve/model/decoding/logits.py"
RUNNER = "tserve/model/decoding/lm_runner.py"
SPECULATIVE = "tserve/model/decoding/speculative.py"
GENERATION = "tserve/service/engine/generation.py"
KV = "tserve/model/kv_cache.py"
DECODER = "tserve/model/decoder.py"
COMPLETIONS = "tserve/service/routes/completions.py"
TOOL_CALLS = "tserve/service/generation/tool_calls.py"
TRANSLATION_INPUT = "tserve/service/engine/translation_input.py"
TOP_TOKENS = "tserve/model/decoding/top_tokens.py"

BATCHED = "tests/engine/test_option_combinations_batched.py::"
FRESH_FIRST = f"{BATCHED}test_a_fresh_prompt_prefilled_before_cached_prefix_readers_leaves_every_row_as_alone"
PREFIX_INTACT = f"{BATCHED}test_a_cached_prefix_shared_by_rows_of_different_options_stays_intact_for_a_later_request"
SEED_0 = f"{BATCHED}test_seed_0_draws_the_same_tokens_each_time_beside_other_seeds"
ENGINE = "tests/engine/test_engine.py::"
SAMPLED_AMONG_OTHERS = f"{ENGINE}test_sampled_requests_with_penalties_and_bias_alone_equal_among_others"
GENERATION_TESTS = "tests/model/test_generation.py::"
RULED_OUT = f"{GENERATION_TESTS}test_rows_whose_constraints_only_rule_ids_out_take_the_argmax_of_the_rest"
CACHE = "tests/model/test_option_combinations_cache.py::"
SHARED_PREFIX = (f"{CACHE}test_steps_over_a_shared_prefix_and_a_fresh_prompt_equal_the_whole_forward_for_each_backend"
                 "_and_block_size[trained-mha-math-1]")
SPEC = "tests/engine/test_speculative.py::"
SPEC_OPTIONS = f"{SPEC}test_every_sampling_and_stopping_option_gives_with_drafts_what_it_gives_without[layers]"
PAIRS = "tests/engine/test_option_combinations_speculative_pairs.py::"
DRAFTING_BATCH = f"{PAIRS}test_constrained_and_penalized_rows_in_a_drafting_batch_write_what_they_write_without_speculation"
FOLLOW_UP = f"{PAIRS}test_a_follow_up_turn_reads_every_block_a_speculative_answer_filled"
PADDED_DRAFT = f"{PAIRS}test_a_draft_model_whose_output_layer_is_padded_drafts_only_shared_tokens"
MT = "tests/engine/test_option_combinations_translation_pairs.py::"
PAGE_BEAMS = f"{MT}test_an_html_pages_and_a_files_blocks_take_the_requests_beams"
PAGE_ALTERNATIVES = f"{MT}test_an_html_page_has_as_many_alternatives_as_its_requests_beams"
TERM_FITS = f"{MT}test_a_glossary_term_fits_in_max_tokens_of_its_tokens_and_eos"
STREAMED_TERM = f"{MT}test_a_streamed_greedy_sentence_with_a_glossary_term_streams_as_the_beam_search_it_becomes"
ROUTING = "tests/engine/test_translation_routing.py::"
TOP_TOKEN_PATHS = ("tests/model/test_top_tokens.py::test_every_rule_but_the_banned_ids_sends_its_row_down_the_full_path"
                   "_and_the_rest_take_top_tokens[chunked]")
STREAM = "tests/http/test_option_combinations_streaming_pairs.py::"
CALL_LOGPROBS = f"{STREAM}test_several_streamed_choices_of_a_tool_call_each_carry_their_own_logprobs"
ROLE_CHUNKS = f"{STREAM}test_each_streamed_choice_opens_with_its_own_assistant_role"
AUTO_CALL = f"{STREAM}test_an_auto_answer_that_is_a_call_streams_as_the_call_it_is_unstreamed"
CALL_CUT = f"{STREAM}test_a_call_then_text_cut_by_max_tokens_finishes_with_tool_calls_streamed_or_not"
HOLDS = ("tests/http/test_tool_call_parsing.py::test_auto_holds_text_that_may_begin_a_call_and_lets_a_cut_off_call_"
         "through_as_text")
OPS = "tests/http/test_option_combinations_operations_pairs.py::"
PRIORITIES = f"{OPS}test_a_keys_priority_and_a_body_priority_reach_the_engine_from_every_route"
LOAD_TO_THE_END = f"{OPS}test_a_load_runs_to_its_end_when_the_client_that_asked_leaves"
MODEL = "tests/model/test_option_combinations_model_pairs.py::"
NON_ADJACENT = f"{MODEL}test_a_rows_prefix_read_back_is_the_same_whether_its_last_block_is_adjacent_or_not"
PAST_THE_TABLE = f"{MODEL}test_padding_past_a_rows_table_leaves_its_own_positions_as_they_were"
WINDOW_POOL = f"{MODEL}test_the_sliding_layers_pool_holds_every_rows_window_and_drafts_and_one_context_besides"

PAIR_BUGS = [
    # A batch of requests with different options.
    Bug("temperature-skipped-when-first-row-untempered", LOGITS,
        "        if all(t == 1.0 for t in temps):", "        if temps[0] == 1.0:", (SAMPLED_AMONG_OTHERS,)),
    Bug("greedy-fast-path-when-any-row-is-greedy", RUNNER,
        "if all(p.greedy and p.logprobs is None for p in params) and",
        "if any(p.greedy and p.logprobs is None for p in params) and",
        ("tests/engine/test_mutation_gaps.py::test_logprobs_through_the_engine_equal_a_recompute",)),
    Bug("greedy-exclusions-judged-by-the-first-row", LOGITS,
        "        if any(self._reshapes(r) for r in rows):\n            return None",
        "        if self._reshapes(rows[0]):\n            return None", (RULED_OUT,)),
    Bug("prefill-start-offsets-read-from-the-first-row", RUNNER,
        "to_device(start, dev) if any(start) else None,", "to_device(start, dev) if start[0] else None,",
        (f"{FRESH_FIRST}[layers]", f"{FRESH_FIRST}[fused-q4_0]")),
    Bug("prefill-attends-as-far-as-the-first-rows-end", RUNNER,
        "kv_len=max(b + n for b, n in zip(start, lengths, strict=True)))", "kv_len=start[0] + max(lengths))",
        (f"{FRESH_FIRST}[layers]", f"{PREFIX_INTACT}[fused-q4_0]")),
    Bug("decode-mask-skipped-by-first-rows-position", DECODER,
        "int(positions.min()) == kv_len - 1", "int(positions[0]) == kv_len - 1", (SHARED_PREFIX,)),
    Bug("speculative-logprob-width-of-the-first-row", RUNNER,
        "            n_top = max(s.params.logprobs or 0 for s in seqs)",
        "            n_top = seqs[0].params.logprobs or 0", (SPEC_OPTIONS,)),
    Bug("presence-and-frequency-penalties-swapped", LOGITS,
        "penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).to(scores.dtype)",
        "penalty = presence[:, None] * counts + frequency[:, None] * (counts > 0).to(scores.dtype)",
        (f"{GENERATION_TESTS}test_penalties_follow_openai_formula",)),
    Bug("seed-0-is-unseeded", "tserve/model/decoding/params.py",
        "        if self.seed is not None:\n            g.manual_seed(self.seed)",
        "        if self.seed:\n            g.manual_seed(self.seed)", (f"{SEED_0}[layers]", f"{SEED_0}[fused-q4_0]")),
    Bug("decode-reads-as-far-as-the-first-row", KV,
        "        return self.positions[:, -1] + 1  # (B,)",
        "        return (self.positions[:, -1] + 1).clamp(min=int(self.positions[0, -1]) + 1)  # (B,)",
        (f"{ENGINE}test_greedy_alone_equals_among_fifty_others",)),
    Bug("one-row-slice-read-for-a-batch", KV,
        'if rows.device.type != "cpu" or rows.numel() != 1:', 'if rows.device.type != "cpu":',
        (SHARED_PREFIX.replace("-1]", "-5]"),)),
    Bug("eos-ban-of-one-row-fills-every-row", LOGITS,
        "        if len(idx) == scores.size(0):  # every row", "        if idx:  # every row",
        (f"{GENERATION_TESTS}test_eos_ban_banned_ids_and_forced_eos_follow_each_rows_state",)),
    Bug("greedy-eos-exclusions-of-the-first-row", LOGITS,
        "return [self.banned + self.eos_ids if self._eos_banned(r) else self.banned for r in rows]",
        "return [self.banned + self.eos_ids if self._eos_banned(rows[0]) else self.banned for r in rows]",
        (RULED_OUT,)),
    Bug("tempering-written-into-the-constrained-scores", LOGITS,
        "        return scores / to_device(temps, scores.device)[:, None]",
        "        return scores.div_(to_device(temps, scores.device)[:, None])",
        ("tests/model/test_option_combinations_sampling.py::"
         "test_reported_logprobs_are_the_constrained_distributions_before_temperature",)),
    Bug("completions-choices-share-one-seed", COMPLETIONS,
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, j, body.logprobs, bias, grammar)) for ids in encoded",
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, 0, body.logprobs, bias, grammar)) for ids in encoded",
        ("tests/http/test_http_contract.py::test_choice_j_of_n_uses_seed_plus_j",)),
    # Speculative decoding beside another feature.
    Bug("speculative-step-skips-grammar-masks", RUNNER,
        "        self._attach_masks(seqs)\n        tokens, constrained, chosen, where = accept(",
        "        tokens, constrained, chosen, where = accept(", (f"{DRAFTING_BATCH}[ngram]",)),
    Bug("draft-model-drafts-for-constrained-rows", RUNNER,
        "        rooms = [room if room > 0 and spec.drafting(s) else 0 for s, room in zip(seqs, rooms, strict=True)]\n"
        "        if self.drafter is not None:\n            out = self.drafter.draft(seqs, rooms)\n        else:\n"
        "            out = []\n            for s, room in zip(seqs, rooms, strict=True):\n",
        "        if self.drafter is not None:\n            out = self.drafter.draft(seqs, rooms)\n        else:\n"
        "            out = []\n            for s, room in zip(seqs, rooms, strict=True):\n"
        "                room = room if room > 0 and spec.drafting(s) else 0\n",
        (f"{DRAFTING_BATCH}[draft-model]",)),
    Bug("speculative-logprobs-only-when-every-row-asks", RUNNER,
        "        if any(s.params.logprobs is not None for s in seqs):\n            n_top",
        "        if all(s.params.logprobs is not None for s in seqs):\n            n_top", (SPEC_OPTIONS,)),
    Bug("speculative-top-logprobs-of-the-fewest", RUNNER,
        "            n_top = max(s.params.logprobs or 0 for s in seqs)",
        "            n_top = min(s.params.logprobs or 0 for s in seqs)", (SPEC_OPTIONS, f"{DRAFTING_BATCH}[ngram]")),
    Bug("sampled-draft-logprobs-of-the-greedy-choice", SPECULATIVE,
        "        for j, t in enumerate(tokens):\n            chosen[start + j] = t\n", "", (SPEC_OPTIONS,)),
    Bug("speculative-logprobs-after-temperature", SPECULATIVE,
        "    return out, constrained, torch.tensor(chosen", "    return out, shaped, torch.tensor(chosen",
        (SPEC_OPTIONS,)),
    Bug("speculative-logprob-of-the-row-not-the-position", GENERATION,
        "token_logprob(self.tokenizer, req.params.logprobs, token, at, logprobs)",
        "token_logprob(self.tokenizer, req.params.logprobs, token, i, logprobs)", (SPEC_OPTIONS,)),
    Bug("greedy-drafts-judged-on-raw-logits", SPECULATIVE,
        "greedy_choice = argmax(shaped).tolist()", "greedy_choice = argmax(scores).tolist()", (SPEC_OPTIONS,)),
    Bug("draft-model-vocab-from-the-draft", "tserve/model/decoding/draft_model.py",
        "self.vocab_size = min(target.config.vocab_size, loaded.config.vocab_size)",
        "self.vocab_size = loaded.config.vocab_size", (PADDED_DRAFT,)),
    Bug("speculative-blocks-named-with-rejected-drafts", RUNNER,
        "self.blocks.name_full_blocks(s.table, (s.token_ids() + d[:kept])[:n])",
        "self.blocks.name_full_blocks(s.table, s.token_ids() + d)", (f"{FOLLOW_UP}[ngram]",)),
    Bug("speculative-scores-indexed-by-draft-length", SPECULATIVE,
        "            flat_index.append(i * logits.size(1) + j)", "            flat_index.append(i * (len(d) + 1) + j)",
        (f"{SPEC}test_greedy_output_is_identical_with_speculation_and_drafts_are_both_kept_and_rejected[layers]",)),
    Bug("frequency-penalized-rows-drafted-for", SPECULATIVE,
        "    return seq.grammar is None and not seq.params.penalized",
        "    return seq.grammar is None and not seq.params.presence_penalty", (f"{DRAFTING_BATCH}[ngram]",)),
    Bug("a-row-without-a-draft-turns-the-step-plain", GENERATION,
        "        if not any(drafts[id(r)] for r in reqs):\n            self._isolated(reqs, self._decode_forward",
        "        if not all(drafts[id(r)] for r in reqs):\n            self._isolated(reqs, self._decode_forward",
        (f"{DRAFTING_BATCH}[ngram]",)),
    # Translation features together.
    Bug("file-job-drops-num-beams", "tserve/service/routes/files.py",
        'ask = TranslationAsk([], _form_int(form, "num_beams"),', "ask = TranslationAsk([], None,",
        ("tests/http/test_files.py::test_hostile_and_wrong_files_are_4xx_naming_what_is_wrong",)),
    Bug("pivot-first-hop-takes-the-requests-beams", "tserve/service/translation/routing.py",
        "return TranslationAsk(texts, None, ask.max_tokens, 1,", "return TranslationAsk(texts, ask.num_beams, ask.max_tokens, 1,",
        (f"{ROUTING}test_a_first_hop_is_asked_one_beam_and_no_alternatives_the_last_hop_the_request",)),
    Bug("beam-length-penalty-of-the-first-request", "tserve/model/decoding/beam_search.py",
        "torch.tensor([pen(x.cur_len) for x in searches], device=device)[:, None]",
        "torch.tensor([pen(first.cur_len) for x in searches], device=device)[:, None]",
        ("tests/engine/test_translation_engine.py::test_forty_mixed_requests_equal_each_alone[none]",)),
    Bug("glossary-term-and-eos-refused-at-exact-fit", TRANSLATION_INPUT,
        "if sum(map(len, job.constraints)) + 1 > job.max_new_tokens:",
        "if sum(map(len, job.constraints)) + 1 >= job.max_new_tokens:", (TERM_FITS,)),
    Bug("beam-candidates-fast-and-full-path-rows-not-reordered", TOP_TOKENS,
        "    return (torch.empty_like(values).index_copy_(0, order, values),\n"
        "            torch.empty_like(ids).index_copy_(0, order, ids))",
        "    return values, ids", (TOP_TOKEN_PATHS,)),
    Bug("pivot-document-alternatives-limited-by-the-surest-sentence", "tserve/service/translation/routing.py",
        "for k in range(max(len(s.alternatives) for s in sentences) if n > 1 else 1):",
        "for k in range(min(len(s.alternatives) for s in sentences) if n > 1 else 1):",
        (f"{ROUTING}test_a_documents_sentences_from_two_hops_join_into_its_layout_with_alternatives",)),
    Bug("memory-partial-hits-misnumber-the-engines-sentences", "tserve/service/translation/served.py",
        "return TranslationRun(self, keys, remembered, dict(zip(todo, reqs, strict=True)))",
        "return TranslationRun(self, keys, remembered, dict(enumerate(reqs)))",
        ("tests/engine/test_option_combinations_operations.py::test_a_file_job_of_each_format_keeps_its_glossary[epub]",)),
    Bug("a-preempted-source-stays-encoded", "tserve/model/decoding/seq2seq_runner.py",
        "        seq.encoded = slot in self._source_of_slot\n",
        "        seq.encoded = seq.encoded or slot in self._source_of_slot\n",
        ("tests/engine/test_translation_preemption.py::test_preempted_requests_finish_as_alone[plain]",)),
    Bug("markup-blocks-drop-the-beams", TRANSLATION_INPUT,
        "docs = [self.document(b.text, num_beams, max_tokens, glossary, languages) for b in markup.blocks]",
        "docs = [self.document(b.text, None, max_tokens, glossary, languages) for b in markup.blocks]",
        (PAGE_BEAMS, PAGE_ALTERNATIVES)),
    Bug("markup-blocks-drop-max-tokens", TRANSLATION_INPUT,
        "docs = [self.document(b.text, num_beams, max_tokens, glossary, languages) for b in markup.blocks]",
        "docs = [self.document(b.text, num_beams, None, glossary, languages) for b in markup.blocks]",
        ("tests/files/test_option_combinations_files.py::test_a_file_jobs_max_tokens_bounds_each_sentence[txt]",)),
    Bug("greedy-full-path-rows-read-at-their-index", TOP_TOKENS,
        "scores = logits.index_select(0, to_device([places[j] for j in whole], dev)).float()",
        "scores = logits.index_select(0, at).float()", (TOP_TOKEN_PATHS,)),
    Bug("html-pages-drop-the-beams", TRANSLATION_INPUT,
        "        return self.markup_document(markup, num_beams, max_tokens, glossary, languages)",
        "        return self.markup_document(markup, None, max_tokens, glossary, languages)",
        (PAGE_BEAMS, PAGE_ALTERNATIVES)),
    Bug("files-drop-the-beams", "tserve/service/translation/served.py",
        "return [translator.markup_document(m, ask.num_beams, ask.max_tokens, ask.glossary, languages)",
        "return [translator.markup_document(m, None, ask.max_tokens, ask.glossary, languages)", (PAGE_BEAMS,)),
    Bug("streamed-glossary-greedy-sentence-takes-the-token-route", "tserve/service/routes/translations.py",
        "    if len(doc.jobs) == 1 and doc.jobs[0].num_beams == 1 and body.n == 1:",
        "    if len(doc.jobs) == 1 and body.num_beams == 1 and body.n == 1:", (STREAMED_TERM,)),
    # Streamed chat beside tools, choices and logprobs.
    Bug("tool-stream-logprobs-shared-between-choices", COMPLETIONS,
        "unsent: dict[int, list[TokenLogprob]] = {c.index: [] for c in choices}",
        "unsent: dict[int, list[TokenLogprob]] = dict.fromkeys((c.index for c in choices), [])", (CALL_LOGPROBS,)),
    Bug("chat-role-chunk-always-index-0", COMPLETIONS,
        'yield _choice_chunk(base, c, {"index": c.index, "delta": {"role": "assistant", "content": ""},',
        'yield _choice_chunk(base, c, {"index": 0, "delta": {"role": "assistant", "content": ""},', (ROLE_CHUNKS,)),
    Bug("auto-stream-whitespace-before-call-not-held", TOOL_CALLS, "    s = text.lstrip()\n", "    s = text\n",
        (HOLDS,)),
    Bug("detok-flush-not-forced", "tserve/model/detokenizer.py",
        "        return self._delta(force=True)", "        return self._delta(force=False)",
        ("tests/model/test_tokenizer.py::test_byte_level_streams_hold_back_only_a_character_that_can_still_finish",)),
    Bug("auto-tools-stream-as-plain-text", COMPLETIONS,
        '                if tools.mode == "none":\n', "                if not tools.constrained:\n",
        (AUTO_CALL, CALL_CUT)),
    Bug("tools-auto-beside-a-response-format-refused", COMPLETIONS,
        "    if tools is not None and tools.constrained:\n", "    if tools is not None and tools.names:\n",
        (AUTO_CALL,)),
    Bug("unstreamed-calls-cut-by-max-tokens-finish-with-length", COMPLETIONS,
        '        if o["message"].get("tool_calls"):\n',
        '        if o["message"].get("tool_calls") and o["finish_reason"] == "stop":\n', (CALL_CUT,)),
    Bug("streamed-required-call-cut-by-max-tokens-errors", TOOL_CALLS,
        "        except (json.JSONDecodeError, TypeError, KeyError):  # cut by max_tokens",
        "        except (TypeError, KeyError):  # cut by max_tokens", (HOLDS,)),
    Bug("streamed-text-after-calls-dropped", TOOL_CALLS,
        '        out = [{"content": content}] if content else []\n', "        out = []\n",
        ("tests/http/test_tool_call_parsing.py::test_stream_deltas_in_full", CALL_CUT)),
    Bug("bare-json-call-not-held-while-streaming", TOOL_CALLS,
        'for marker in ("<tool_call>", _PYTHON_TAG, "{"))', 'for marker in ("<tool_call>", _PYTHON_TAG))',
        (HOLDS, AUTO_CALL)),
    # Operations together.
    Bug("falsy-flags-lose-to-the-environment", "tserve/service/cli.py",
        "if getattr(args, name, None) is not None}", "if getattr(args, name, None)}",
        ("tests/deploy/test_option_combinations_cli.py::test_make_serve_runs_tserve_serve_with_its_serve_args",)),
    Bug("max-queue-0-refuses-an-exact-fit", "tserve/service/engine/admission.py",
        "if needed and needed > free_rows - held and", "if needed and needed >= free_rows - held and",
        ("tests/engine/test_admission_policy.py::test_max_queue_0_takes_what_the_rows_left_by_the_waiting_take",)),
    Bug("running-requests-never-time-out", "tserve/service/engine/worker.py",
        "for req in [r for r in self.running if r.cancelled or now > r.deadline]:",
        "for req in [r for r in self.running if r.cancelled]:",
        ("tests/engine/test_worker_behaviour.py::test_a_running_request_past_its_deadline_times_out[lm-engine]",)),
    Bug("per-key-limit-off-by-one", "tserve/service/security.py",
        "if self.limit and self.in_flight[key] >= self.limit:", "if self.limit and self.in_flight[key] > self.limit:",
        ("tests/http/test_security.py::test_in_flight_limit_per_key",)),
    Bug("libretranslate-key-priority-not-applied", "tserve/service/routes/libretranslate.py",
        "    gate.admit_as(key)\n    try:", "    try:", (PRIORITIES,)),
    Bug("chat-body-priority-ignored", COMPLETIONS,
        "    served = served_model(request, body.model, ServedLanguageModel.task, body.priority)\n"
        "    if served.tokenizer.chat_template is None:",
        "    served = served_model(request, body.model, ServedLanguageModel.task)\n"
        "    if served.tokenizer.chat_template is None:", (PRIORITIES,)),
    Bug("translation-body-priority-ignored", "tserve/service/routes/translations.py",
        "    prioritise(body.priority)\n    inputs = ", "    inputs = ", (PRIORITIES,)),
    Bug("repository-load-cut-by-a-leaving-client", "tserve/service/routes/repository.py",
        "    await _to_the_end(change())", "    await change()", (LOAD_TO_THE_END,)),
    # The paged cache's features together.
    Bug("sliding-window-skipped-when-the-queries-fit", DECODER,
        "        if keys <= window:", "        if positions.size(1) <= window:",
        ("tests/model/test_window_blocks.py::test_a_cached_prefix_counts_as_far_as_its_last_window_is_held",)),
    Bug("fused-partial-rotary-on-the-whole-head", "tserve/model/fused_decode.py",
        "rotary = (cfg.rotary_dim or cfg.d_head) if", "rotary = cfg.d_head if",
        ("tests/model/test_fused_decode.py::test_fused_steps_equal_the_layers_steps[phi3-smollm3-granite-float32]",)),
    Bug("contiguous-read-counts-whole-blocks-only", KV,
        "        n = -(-kv_len // self.block_size)\n        blocks = self._host_tables",
        "        n = kv_len // self.block_size or 1\n        blocks = self._host_tables",
        (f"{NON_ADJACENT}[llama-math]", f"{NON_ADJACENT}[gemma3-cpu-decode]")),
    Bug("window-pool-sized-without-the-drafts", "tserve/model/window_blocks.py",
        "per_row = -(-(window + ahead) // block_size) + 1", "per_row = -(-window // block_size) + 1",
        (f"{WINDOW_POOL}[4]", f"{WINDOW_POOL}[7]")),
    Bug("mask-dropped-when-the-last-row-is-at-the-end", DECODER,
        "int(positions.min()) == kv_len - 1", "int(positions.max()) == kv_len - 1", (SHARED_PREFIX,)),
    Bug("softcapped-gemma2-fused", "tserve/model/fused_decode.py",
        "or cfg.n_experts or cfg.attention_softcap is not None:", "or cfg.n_experts:",
        ("tests/model/test_option_combinations_models.py::"
         "test_gemma2s_decode_steps_soft_cap_their_attention_scores_as_the_whole_forward_does[as-served]",)),
    Bug("beam-fork-copies-one-position-short", "tserve/model/block_pool.py",
        "forked.blocks[-1], num_tokens % self.block_size)", "forked.blocks[-1], num_tokens % self.block_size - 1)",
        ("tests/model/test_paged_kv.py::test_a_forked_table_shares_its_full_blocks_and_copies_the_last_partial_one",)),
    Bug("gguf-gemma-sliding-pattern-dense-first", "tserve/model/gguf/families.py",
        "sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]",
        "sliding = [pattern == 0 or i % pattern > 0 for i in range(n)]",
        ("tests/model/test_option_combinations_gguf.py::"
         "test_gemma_layers_slide_in_llama_cpps_pattern_when_the_file_stores_none",
         "tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[gemma3]")),
    Bug("writes-past-the-table-land-in-the-last-block", KV,
        "        write = torch.where(positions < self.max_len, write, positions % bs)  # past the table: the null block\n",
        "", (f"{PAST_THE_TABLE}[llama]", f"{PAST_THE_TABLE}[gemma3]")),
    Bug("window-blocks-named-a-block-late", "tserve/model/window_blocks.py",
        "if num_tokens // self.block_size > len(table.hashes):",
        "if num_tokens // self.block_size > len(table.hashes) + 1:",
        ("tests/model/test_window_blocks.py::"
         "test_asynchronous_steps_on_sliding_layers_stream_the_same_and_name_both_pools_blocks",)),
    Bug("decode-steps-attend-one-position-short", RUNNER,
        "self.cache, rows, kv_len=max(positions) + 1)", "self.cache, rows, kv_len=max(positions))", (SHARED_PREFIX,)),
    Bug("maps-requested-layers-run-unwindowed", DECODER,
        "            if i in self.sliding_layers:\n", "            if i in self.sliding_layers and not want:\n",
        ("tests/model/test_option_combinations_inspection_models.py::"
         "test_grouped_query_maps_of_every_query_head_equal_transformers[gemma2]",)),
    # Fixed where two features met: a token split over bytes with logprobs; a glossary through a pivot.
    Bug("chat-logprobs-bytes-of-the-shown-token", COMPLETIONS,
        '"bytes": list(token_bytes(token))}', '"bytes": list(token.encode("utf-8"))}',
        (f"{STREAM}test_chat_logprobs_bytes_join_into_the_characters_a_token_splits",)),
    Bug("pivot-first-hop-drops-the-glossary", "tserve/service/translation/routing.py",
        "return TranslationAsk(texts, None, ask.max_tokens, 1, glossary,",
        "return TranslationAsk(texts, None, ask.max_tokens, 1, None,",
        ("tests/files/test_option_combinations_files.py::test_a_pivoted_files_glossary_term_goes_through_both_hops",
         f"{ROUTING}test_a_first_hop_is_asked_one_beam_and_no_alternatives_the_last_hop_the_request")),
    Bug("pivot-last-hop-looks-for-the-requests-source-terms", "tserve/service/translation/routing.py",
        "        glossary = {term: term for term in glossary.values()}\n", "        pass\n",
        ("tests/files/test_option_combinations_files.py::test_a_pivoted_files_glossary_term_goes_through_both_hops",
         f"{ROUTING}test_a_first_hop_is_asked_one_beam_and_no_alternatives_the_last_hop_the_request")),
]
PAIR_BUGS += PAIR_BUGS_MORE
