"""Planted bugs where two features meet, the third survey's second half: structured output beside several end ids,
biases, min_tokens and other grammars in one batch (`tests/engine/test_option_combinations_structured_pairs.py`);
asynchronous scheduling beside translators' forced tokens and the served models' settings
(`tests/engine/test_option_combinations_async_pairs.py`); GGUF files served with their chat templates, end ids and
grammars (`tests/model/test_option_combinations_served_families.py`); attention maps, the logit lens, embeddings and
the Open Inference Protocol beside several inputs, choices, echo, stop strings and beams
(`tests/http/test_option_combinations_inspection_pairs.py`); and the module tests named. Part of
`tests/tools/pair_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

LOGITS = "tserve/model/decoding/logits.py"
RUNNER = "tserve/model/decoding/lm_runner.py"
COMPLETIONS = "tserve/service/routes/completions.py"
TRANSLATIONS = "tserve/service/routes/translations.py"
GGUF_TOKENIZER = "tserve/model/gguf/tokenizer.py"
RULED_OUT = ("tests/model/test_generation.py::"
             "test_rows_whose_constraints_only_rule_ids_out_take_the_argmax_of_the_rest")
ASYNC_EVERY_OPTION = ("tests/engine/test_async_scheduling.py::"
                      "test_every_option_streams_what_the_synchronous_engine_streams[layers]")
STRUCTURED = "tests/engine/test_option_combinations_structured_pairs.py::"
MASK = f"{STRUCTURED}test_every_eos_id_is_allowed_exactly_where_the_grammar_may_end"
BIAS = (f"{STRUCTURED}test_a_bias_towards_any_eos_id_ends_a_constrained_answer_where_it_may_end_and_min_tokens_holds"
        "_each_back")
BATCH = f"{STRUCTURED}test_requests_with_different_grammars_and_options_in_one_batch_each_get_what_they_get_alone"
ASYNC = "tests/engine/test_option_combinations_async_pairs.py::"
FORCED = f"{ASYNC}test_forced_first_and_last_tokens_come_where_the_synchronous_engine_puts_them"
ASYNC_SETTING = f"{ASYNC}test_the_servers_async_scheduling_setting_reaches_the_language_model_and_the_translator"
FAMILIES = "tests/model/test_option_combinations_served_families.py::"
CHAT_IDS = f"{FAMILIES}test_a_files_chat_prompt_is_its_originals_around_each_special_token"
SERVED_MISTRAL = f"{FAMILIES}test_a_sentencepiece_file_chats_as_its_original_is_served"
END_IDS = f"{FAMILIES}test_a_files_end_ids_are_exactly_its_originals"
LOOK = "tests/http/test_option_combinations_inspection_pairs.py::"
OWN_MAPS = f"{LOOK}test_each_choices_maps_are_its_own_prompt_and_tokens_when_prompts_differ_and_n_is_two"
COMPLETION_BOUND = f"{LOOK}test_the_completion_weight_bound_counts_every_choice_and_the_longest_prompt"
CHOICE_MAPS = f"{LOOK}test_each_choices_maps_are_its_own_prompt_and_tokens_when_prompts_differ_and_n_is_two"
MAPS_OWN_PROMPT = "served.loaded, ids, *attention, len(c.request.prompt_ids))"
SERVED_MT = "tserve/service/translation/served.py"
LIBRETRANSLATE = "tserve/service/routes/libretranslate.py"
MEMORY = "tests/engine/test_option_combinations_memory_pairs.py::"
SPELLED = f"{MEMORY}test_a_sentence_spelled_otherwise_is_not_answered_with_the_stored_spellings_translation"
PIVOTED_CACHE_FALSE = f"{MEMORY}test_a_pivoted_html_page_with_cache_false_neither_reads_nor_fills_either_hops_memory"
HTML_LANGUAGE = f"{MEMORY}test_an_html_pages_language_is_detected_on_the_text_it_shows"
IMAGES = "tserve/service/vision/images.py"
BATCHER = "tests/engine/test_option_combinations_batcher_pairs.py::"
URGENT = f"{BATCHER}test_an_urgent_image_request_goes_into_the_next_batch_before_earlier_ones"
TEXT_EMBEDDINGS = f"{BATCHER}test_text_embeddings_of_other_lengths_and_formats_sharing_a_batch_equal_each_alone"
TEXT_FILES = "tserve/service/translation/files/text_files.py"
FILE_PAIRS = "tests/files/test_option_combinations_file_pairs.py::"
METRIC_PAIRS = "tests/engine/test_option_combinations_metrics_pairs.py::"
SETTINGS = "tests/deploy/test_option_combinations_settings_pairs.py::"
MAX_N = f"{SETTINGS}test_max_n_and_max_prompts_are_separate_limits_on_completions_and_chat"
HELD = f"{SETTINGS}test_max_model_memory_counts_a_quantized_models_packed_weights"
TURNS = "tests/http/test_option_combinations_conversation_pairs.py::"
BLOCK_POOL = "tserve/model/block_pool.py"
SCHEMAS = "tserve/service/request_schemas.py"
LEGACY = "tests/http/test_option_combinations_completions_pairs.py::"
AS_ALONE = f"{LEGACY}test_a_list_of_prompts_with_n_seeded_echoed_choices_answers_each_prompt_as_if_alone"
ECHOED_LOGPROBS = f"{LEGACY}test_echoed_prompt_logprobs_of_several_prompts_are_each_prompts_forward_pass"
TOKEN_PROMPTS = f"{LEGACY}test_prompts_given_as_token_ids_answer_as_the_same_prompts_given_as_text"
REPLACED = ("tests/engine/test_option_combinations_metrics.py::"
            "test_a_replaced_model_draining_leaves_the_names_gauges_to_the_new_one")
REMEMBERED_USAGE = (f"{METRIC_PAIRS}test_a_remembered_translation_generates_nothing_and_streamed_reports_the_usage_of_a"
                    "_translated_one")

PAIR_BUGS_MORE = [
    # Structured output beside another feature.
    Bug("greedy-exclusions-only-when-every-row-reshapes", LOGITS,
        "        if any(self._reshapes(r) for r in rows):\n            return None",
        "        if all(self._reshapes(r) for r in rows):\n            return None", (RULED_OUT,)),
    Bug("greedy-fast-path-ignores-the-grammar-mask", LOGITS,
        "            _forced_first(row) is not None or _token_mask(row) is not None",
        "            _forced_first(row) is not None", (f"{BATCH}[off]",)),
    Bug("overlapped-steps-ignore-grammar-rows-unread-tokens", RUNNER,
        "        return seq.params.penalized or seq.grammar is not None", "        return seq.params.penalized",
        (ASYNC_EVERY_OPTION, f"{BATCH}[on]")),
    Bug("overlap-reads-tokens-only-when-every-row-needs-them", "tserve/service/engine/generation.py",
        "any(\n                self.runner.needs_tokens(r) for r in self.running)",
        "all(\n                self.runner.needs_tokens(r) for r in self.running)", (ASYNC_EVERY_OPTION, f"{BATCH}[on]")),
    Bug("grammar-compiler-knows-only-the-tokenizers-eos", RUNNER,
        "sorted(self.eos_ids), max_grammar_compile_ms)", "[] if eos is None else [eos], max_grammar_compile_ms)",
        (MASK, BIAS, f"{FAMILIES}test_every_end_id_ends_a_constrained_answer_as_it_ends_a_free_one[<|endoftext|>]")),
    Bug("grammar-eos-rescue-on-any-masked-token", LOGITS,
        "dead = torch.isinf(rows_scores).all(-1, keepdim=True)", "dead = torch.isinf(rows_scores).any(-1, keepdim=True)",
        ("tests/model/test_option_combinations_sampling.py::test_a_grammar_that_allows_only_eos_wins_over_min_tokens",)),
    Bug("json-grammar-allows-free-whitespace", "tserve/model/decoding/structured.py",
        '                    self.spec, defaults={"whitespace_flexible": False})', "                    self.spec)",
        ("tests/model/test_structured_output.py::test_every_sampled_answer_that_stops_validates[gpt2]",)),
    Bug("lltokenizer-given-the-first-eos-id-only", "tserve/model/decoding/structured.py",
        "eos_token=self.eos_ids or None)", "eos_token=self.eos_ids[0] if self.eos_ids else None)", (MASK, BIAS)),
    # Asynchronous scheduling beside another feature.
    Bug("translation-forced-tokens-judged-by-tokens-read", "tserve/model/decoding/seq2seq_runner.py",
        "    def num_generated(self) -> int:\n        return len(self.generated) + self.unresolved if self.greedy",
        "    def num_generated(self) -> int:\n        return len(self.generated) if self.greedy",
        (f"{FORCED}[nllb]", f"{FORCED}[marian]")),
    Bug("prefix-blocks-named-before-their-last-token-is-fed", RUNNER,
        "            known = min(seq.num_computed, len(seq.prompt_ids) + len(seq.generated))",
        "            known = len(seq.prompt_ids) + len(seq.generated)",
        ("tests/model/test_window_blocks.py::"
         "test_asynchronous_steps_on_sliding_layers_stream_the_same_and_name_both_pools_blocks",)),
    Bug("feed-tokens-taken-at-the-batch-place", "tserve/model/decoding/chosen_tokens.py",
        "step.tokens.index_select(0, to_device(rows, device))", "step.tokens.index_select(0, to_device(at, device))",
        (ASYNC_EVERY_OPTION,)),
    Bug("served-translator-ignores-async-scheduling", "tserve/service/translation/served.py",
        "kv_block_size=s.kv_block_size, async_scheduling=s.async_scheduling)", "kv_block_size=s.kv_block_size)",
        (ASYNC_SETTING,)),
    Bug("served-lm-ignores-async-scheduling", "tserve/service/generation/served.py",
        "                                       async_scheduling=s.async_scheduling,\n", "", (ASYNC_SETTING,)),
    Bug("forced-eos-judged-by-the-tokens-read", LOGITS,
        "        return self.force_eos_at_max and row.num_generated == row.params.max_tokens - 1",
        "        return self.force_eos_at_max and len(row.generated) == row.params.max_tokens - 1",
        ("tests/engine/test_translation_engine.py::test_marian_parity_through_the_engine",)),
    Bug("forced-first-token-judged-by-the-tokens-read", LOGITS,
        "    return token if token is not None and row.num_generated == 0 else None",
        "    return token if token is not None and not row.generated else None",
        ("tests/http/test_multilingual_http.py::test_both_directions_in_one_batch_equal_generate",)),
    # GGUF files served with another feature.
    Bug("gguf-spm-bytes-fused-before-byte-fallback", GGUF_TOKENIZER,
        'decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),',
        'decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.ByteFallback(),',
        ("tests/model/test_gguf.py::test_tokenizer_is_the_original[mistral]", SERVED_MISTRAL)),
    Bug("gguf-control-tokens-eat-the-newline-after", GGUF_TOKENIZER,
        "tok.add_tokens([AddedToken(t, special=True, normalized=False)",
        "tok.add_tokens([AddedToken(t, special=True, normalized=False, rstrip=True)",
        (f"{CHAT_IDS}[llama-0]", f"{CHAT_IDS}[qwen2-1]")),
    Bug("gguf-spm-space-prefix-after-every-special-token", GGUF_TOKENIZER,
        'prepend_scheme="first" if space_prefix', 'prepend_scheme="always" if space_prefix',
        (f"{CHAT_IDS}[mistral-0]", SERVED_MISTRAL)),
    Bug("gguf-every-control-token-ends-generation", GGUF_TOKENIZER,
        "if kind == CONTROL and t in END_OF_TURN]", "if kind == CONTROL]",
        (f"{END_IDS}[qwen2]", f"{FAMILIES}test_a_control_token_that_opens_a_turn_is_generated_not_an_end")),
    Bug("explicit-bos-flag-added-to-chat-prompts", "tserve/model/tokenizer.py",
        "if add_special_tokens and self._add_bos and self._bos_id is not None:",
        "if self._add_bos and self._bos_id is not None:", ("tests/model/test_tokenizer.py::test_bpe_roundtrip_and_flags",)),
    Bug("gguf-named-templates-ignored", GGUF_TOKENIZER,
        '        config["chat_template"] = [{"name": "default", "template": template}, *named] if named else template',
        '        config["chat_template"] = template',
        (f"{FAMILIES}test_a_files_tool_use_template_renders_a_request_with_tools_as_its_original",)),
    # Inspection beside several inputs, choices and beams.
    Bug("completions-attention-rows-from-the-longest-prompt", COMPLETIONS,
        MAPS_OWN_PROMPT, "served.loaded, ids, *attention, max_prompt)", (OWN_MAPS,)),
    Bug("completions-attention-bound-counts-prompts-not-choices", COMPLETIONS,
        "attention = attention_selection(served, body.return_attention, body.stream, len(jobs),",
        "attention = attention_selection(served, body.return_attention, body.stream, len(prompts),",
        (COMPLETION_BOUND,)),
    Bug("completions-attention-reads-the-prompt-by-the-wrong-stride", COMPLETIONS,
        "ids = c.request.prompt_ids + c.token_ids", "ids = encoded[c.index // len(encoded)] + c.token_ids",
        (f"{LOOK}test_a_choice_cut_by_a_stop_string_has_the_maps_of_the_tokens_it_returned",)),
    Bug("completions-attention-bound-reads-the-first-prompt", COMPLETIONS,
        "max_prompt = max(len(ids) for ids in encoded)", "max_prompt = len(encoded[0])", (COMPLETION_BOUND,)),
    Bug("completions-echo-attention-rows-include-the-prompt", COMPLETIONS,
        MAPS_OWN_PROMPT, "served.loaded, ids, *attention, 0 if body.echo else len(c.request.prompt_ids))",
        (CHOICE_MAPS,)),
    Bug("translation-attention-bound-reads-the-first-input", TRANSLATIONS,
        "longest = max(len(j.source_ids) for j in jobs)", "longest = len(jobs[0].source_ids)",
        (f"{LOOK}test_the_translation_weight_bound_counts_the_longest_input",)),
    Bug("translation-attention-of-the-first-input", TRANSLATIONS,
        "translation_attention_ids, served.loaded, doc.jobs[0].source_ids,",
        "translation_attention_ids, served.loaded, docs[0].jobs[0].source_ids,",
        (f"{LOOK}test_each_inputs_translation_maps_are_those_it_has_alone",)),
    Bug("beam-translation-ids-of-the-last-hypothesis", "tserve/service/translation/served.py",
        "return TranslationOutput(best_text, [t for seg in segments for t in seg.token_ids], score,",
        "return TranslationOutput(best_text, [t for seg in segments for t in seg.hypotheses[-1].token_ids], score,",
        ("tests/http/test_http_decoding.py::test_attention_scores_what_translations_return",
         f"{LOOK}test_a_beam_translations_maps_read_the_translation_it_returns[glossary]")),
    Bug("embedding-usage-counts-padding", "tserve/service/routes/embeddings.py",
        "tokens = sum(len(ids) for ids in items)", "tokens = len(items) * max(len(ids) for ids in items)",
        (f"{LOOK}test_several_texts_embed_as_each_alone_in_both_encodings_and_count_their_own_tokens[lm]",)),
    Bug("lens-bound-counts-every-layer", "tserve/service/served.py",
        "entries, limit = len(layers) * len(ids) * body.top_k, self.settings.max_lens_entries",
        "entries, limit = count * len(ids) * body.top_k, self.settings.max_lens_entries",
        (f"{LOOK}test_the_lens_bound_counts_the_layers_asked_for",)),
    Bug("oip-translations-drop-n", "tserve/service/translation/served.py",
        "outs = await self.translate(request, docs, n)", "outs = await self.translate(request, docs)",
        (f"{LOOK}test_oip_alternatives_of_several_texts_are_each_texts_own_padded_to_n",)),
    # The translation memory and LibreTranslate's routes beside another feature.
    Bug("weights-hash-without-the-dtype", SERVED_MT,
        'self.weights_hash = f"{weights_hash(files)}/{self.loaded.quantization}/{self.loaded.dtype}{options}"',
        'self.weights_hash = f"{weights_hash(files)}/{self.loaded.quantization}{options}"',
        (f"{MEMORY}test_a_memory_file_shared_with_a_bfloat16_server_keeps_each_dtypes_own_answers",)),
    Bug("weights-hash-of-safetensors-only", SERVED_MT,
        'files = sorted(p for p in self.loaded.path.iterdir() if p.suffix in (".safetensors", ".json"))',
        'files = sorted(p for p in self.loaded.path.iterdir() if p.suffix == ".safetensors")',
        (f"{MEMORY}test_a_translator_reloaded_with_another_generation_config_is_not_answered_from_the_old_ones_memory",)),
    Bug("cache-false-still-fills-the-memory", SERVED_MT,
        "        keys = [self.memory_key(d, i) for d, i in jobs] if memory is not None else []",
        "        keys = [self.memory_key(d, i) for d, i in jobs] if self.memory is not None else []",
        ("tests/engine/test_option_combinations_translation_engine.py::"
         "test_cache_false_neither_reads_nor_fills_the_memory_streamed_or_not", PIVOTED_CACHE_FALSE)),
    Bug("pivoted-html-ignores-cache-false", "tserve/service/translation/routing.py",
        "            outs = await hop[0].translate(request, docs, ask.n if last else 1, cache=ask.cache)",
        "            outs = await hop[0].translate(request, docs, ask.n if last else 1)", (PIVOTED_CACHE_FALSE,)),
    Bug("libretranslate-beams-are-alternatives-plus-one", LIBRETRANSLATE,
        "max(last.loaded.generation.num_beams, n)", "n",
        ("tests/http/test_libretranslate.py::test_form_and_json_bodies_list_q_alternatives_and_auto",)),
    Bug("detect-over-sources-only", LIBRETRANSLATE,
        "        served = sorted({code for pair in translators_by_pair(ready_registry(request)) for code in pair})",
        "        served = sorted({source for source, _ in translators_by_pair(ready_registry(request))})",
        (f"{MEMORY}test_detect_offers_a_language_that_is_only_translated_into",)),
    Bug("languages-lists-direct-targets-only", LIBRETRANSLATE,
        '    codes = sorted({c for pair in pairs for c in pair})\n    return [{"code": c, "name": language_name(c), '
        '"targets": sorted(t for s, t in pairs if s == c)} for c in codes]',
        '    direct = translators_by_pair(ready_registry(request))\n    codes = sorted({c for pair in pairs for c in pair})'
        '\n    return [{"code": c, "name": language_name(c), "targets": sorted(t for s, t in direct if s == c)} for c in '
        'codes]',
        ("tests/http/test_pivot_http.py::test_a_pair_no_model_has_goes_through_english",)),
    Bug("file-auto-source-not-handed-on", "tserve/service/routes/files.py",
        "        first_ask = replace(first_ask, source_lang=ask.source_lang or hops[0][1][0],",
        "        first_ask = replace(first_ask, source_lang=ask.source_lang,",
        (f"{MEMORY}test_libretranslate_translates_a_file_of_a_detected_source_with_a_multilingual_model",)),
    Bug("v1-detected-source-not-handed-on", TRANSLATIONS,
        "        ask = replace(ask, source_lang=body.source_lang or source, target_lang=body.target_lang or target)",
        "        ask = replace(ask, source_lang=body.source_lang, target_lang=body.target_lang or target)",
        (f"{MEMORY}test_v1_translations_without_a_model_or_source_detect_the_source_for_a_multilingual_model",)),
    Bug("streamed-memory-hit-without-tokens", SERVED_MT,
        '            yield Event(result.text, result.token_ids, finish_reason="stop", result=result.hypotheses)',
        '            yield Event(result.text, [], finish_reason="stop", result=result.hypotheses)',
        ("tests/http/test_files.py::"
         "test_a_streamed_translation_is_answered_from_the_memory_as_a_fresh_one_would_be[one-sentence-tokens]",
         REMEMBERED_USAGE)),
    # Fixed where two features met: the memory beside a tokenizer that normalises nothing; auto beside HTML.
    Bug("memory-key-of-the-normalised-text", SERVED_MT,
        "options, job.source_ids)", 'options, [ord(c) for c in " ".join(doc.document.segments[i].split())])',
        (f"{SPELLED}[no-break-space]", f"{SPELLED}[two-spaces]")),
    Bug("html-page-language-detected-on-its-markup", LIBRETRANSLATE,
        '{target}), fmt == "html")', "{target}))", (HTML_LANGUAGE,)),
    Bug("v1-html-page-language-detected-on-its-markup", TRANSLATIONS,
        "body.source_lang, body.target_lang, ask.html)", "body.source_lang, body.target_lang)", (HTML_LANGUAGE,)),
    # The batchers: requests with other options, sizes and priorities in one batch.
    Bug("batched-items-queued-one-by-one", "tserve/service/served.py",
        "        reqs = batcher.enqueue(items)\n", "        reqs = [batcher.enqueue([item])[0] for item in items]\n",
        (f"{BATCHER}test_a_request_of_several_images_counts_once_toward_max_queue",)),
    Bug("classifications-ignore-the-priority", "tserve/service/routes/classifications.py",
        "served_model(request, body.model, ServedClassifier.task, body.priority)",
        "served_model(request, body.model, ServedClassifier.task)", (f"{URGENT}[/v1/classifications]",)),
    Bug("embeddings-ignore-the-priority", "tserve/service/routes/embeddings.py",
        "    prioritise(body.priority)\n", "", (f"{URGENT}[/v1/embeddings]",)),
    Bug("bf16-probabilities-rounded-to-bfloat16", IMAGES,
        "probs = torch.softmax(self.model(batch).float(), dim=-1)", "probs = torch.softmax(self.model(batch), dim=-1).float()",
        (f"{BATCHER}test_a_bfloat16_classifiers_scores_are_the_float32_softmax_of_its_logits",)),
    Bug("oip-probability-rows-aliased", "tserve/service/vision/served.py",
        "probs = [[0.0] * classes for _ in results]", "probs = [[0.0] * classes] * len(results)",
        ("tests/http/test_oip.py::test_classify_bytes_and_pixels",)),
    Bug("embedding-mean-takes-one-padding-position", "tserve/model/embeddings.py",
        "keep = (torch.arange(tokens.size(1), device=dev)[None, :] < lengths[:, None])",
        "keep = (torch.arange(tokens.size(1), device=dev)[None, :] <= lengths[:, None])",
        ("tests/model/test_option_combinations_inspection_models.py::"
         "test_a_batch_of_different_lengths_embeds_each_text_as_alone[phi3-none]", TEXT_EMBEDDINGS)),
    Bug("translator-embeddings-sorted-by-length", SERVED_MT,
        "self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, ids).cpu()))",
        "self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, sorted(ids, key=len)).cpu()))",
        ("tests/http/test_embeddings.py::test_translator_embeddings_are_transformers_mean_encoder_output",
         f"{BATCHER}test_translator_embeddings_in_other_languages_sharing_a_batch_equal_each_alone")),
    Bug("over-long-source-in-a-language-unchecked", SERVED_MT,
        "        if len(ids) > self.loaded.config.max_source_len:\n            raise InvalidInput(f\"the input has",
        "        if False:\n            raise InvalidInput(f\"the input has",
        (f"{BATCHER}test_an_over_long_input_in_a_language_fails_alone_beside_another_clients_inputs",)),
    Bug("embedder-batches-up-to-max-prompts", "tserve/service/served.py",
        'self.embedder = DynamicBatcher(f"{self.name}/embeddings", batch_fn, max_batch_size=s.batch_max_size,',
        'self.embedder = DynamicBatcher(f"{self.name}/embeddings", batch_fn, max_batch_size=s.max_prompts,',
        (TEXT_EMBEDDINGS,)),
    Bug("every-image-ranked-by-the-first-images-labels", IMAGES,
        "for o, sc in zip(order.tolist(), scores.tolist(), strict=True)]",
        "for o, sc in zip([order[0].tolist()] * len(pixels), scores.tolist(), strict=True)]",
        (f"{BATCHER}test_classifications_of_other_images_and_top_k_sharing_a_batch_equal_each_alone",)),
    Bug("batcher-batch-one-past-max-size", "tserve/service/engine/batcher.py",
        "if self._taken >= self.max_batch_size:", "if self._taken > self.max_batch_size:",
        ("tests/engine/test_engine.py::test_batcher_batches_and_isolates_failures",)),
    Bug("abandoned-batch-items-stay-queued", "tserve/service/engine/worker.py",
        "            if not req.finished:\n                req.cancel()\n                self._wake.set()\n", "            pass\n",
        (f"{BATCHER}test_a_client_that_leaves_while_its_images_wait_changes_nothing_for_the_others",)),
    # Fixed where two features met: a failing item beside others in a batch; --max-queue 0 beside a large request.
    Bug("a-failing-batch-fails-every-item", "tserve/service/engine/batcher.py",
        "                results = [self._alone(r.item) for r in reqs]", "                results = [request_error(exc)] * len(reqs)",
        (f"{BATCHER}test_an_item_that_raises_in_a_batch_fails_alone_and_the_others_get_their_results",)),
    Bug("a-request-larger-than-a-batch-never-fits-without-a-queue", "tserve/service/engine/admission.py",
        "        if needed and needed > free_rows - held and not (alone and held + needed > whole):",
        "        if needed and needed > free_rows - held:",
        (f"{BATCHER}test_with_max_queue_0_a_request_of_more_items_than_a_batch_runs_on_an_idle_batcher",)),
    Bug("memory-hits-count-distinct-sentences", SERVED_MT,
        "self.metrics.memory_hits.labels(self.name).inc(len(keys) - len(todo))",
        "self.metrics.memory_hits.labels(self.name).inc(len(found))",
        ("tests/engine/test_option_combinations_metrics.py::"
         "test_a_sentence_a_request_holds_twice_counts_twice_as_a_miss_and_then_as_a_hit",)),
    # Translating files: two features in one job.
    Bug("vtt-rewrap-cuts-inside-a-voice-tag", TEXT_FILES, '        if c == " " and not depth:\n', '        if c == " ":\n',
        (f"{FILE_PAIRS}test_a_two_line_cue_with_a_named_voice_is_cut_outside_the_tag",)),
    Bug("pivoted-job-total-forgets-the-first-hop", "tserve/service/routes/files.py",
        "job.total_segments = job.done_segments + len(hop_doc.jobs)", "job.total_segments = len(hop_doc.jobs)",
        (f"{FILE_PAIRS}test_a_pivoted_jobs_progress_never_passes_its_total",)),
    Bug("file-limits-take-max-file-bytes", "tserve/service/routes/files.py",
        "Limits(max_unzipped_bytes=s.max_unzipped_bytes)", "Limits(max_unzipped_bytes=s.max_file_bytes)",
        ("tests/http/test_files.py::test_each_format_comes_back_translated_with_its_runs_on_the_aligned_words[docx]",)),
    Bug("memory-answer-at-first-place-only", SERVED_MT,
        "        for k, key in enumerate(keys):\n            if key in found:\n",
        "        for key in found:\n            if (k := keys.index(key)) >= 0:\n",
        ("tests/files/test_option_combinations_files.py::"
         "test_a_warm_memory_gives_a_file_the_same_runs_and_cache_false_translates_it_again",)),
    Bug("file-job-drops-progress", "tserve/service/routes/files.py",
        "translate_blocks(hop_doc, current.escape, ask.cache, job.progress)",
        "translate_blocks(hop_doc, current.escape, ask.cache)",
        ("tests/http/test_files.py::test_progress_events_follow_a_job_to_its_end",)),
    Bug("html-drops-its-bom", TEXT_FILES, "lambda rendered: encoded(markup.join(rendered), data),",
        'lambda rendered: markup.join(rendered).encode("utf-8"),',
        (f"{FILE_PAIRS}test_a_byte_order_mark_comes_back_once_in_each_text_format",)),
    Bug("followers-of-an-unsuccessful-job-never-told", "tserve/service/translation/file_jobs.py",
        "            await job.notify()\n", '            if job.status == "succeeded":\n                await job.notify()\n',
        (f"{FILE_PAIRS}test_a_followed_job_cancelled_mid_way_ends_its_changes_and_frees_its_rows",)),
    Bug("utf16-text-files-refused", TEXT_FILES, "    wide = utf16_of(data) if utf16 else None\n",
        "    wide = None\n", (f"{FILE_PAIRS}test_a_utf16_text_file_with_its_byte_order_mark_comes_back_in_utf16[utf-16-le]",)),
    Bug("utf16-text-files-written-back-in-utf8", TEXT_FILES, "    if (wide := utf16_of(data)) is not None:\n",
        "    if (wide := utf16_of(data)) is not None and False:\n",
        (f"{FILE_PAIRS}test_a_utf16_text_file_with_its_byte_order_mark_comes_back_in_utf16[utf-16-be]",)),
    # Usage and metrics beside another feature.
    Bug("remembered-sentences-translated-again", SERVED_MT,
        "todo = [k for k in range(len(jobs)) if not keys or keys[k] not in found]", "todo = list(range(len(jobs)))",
        (REMEMBERED_USAGE,)),
    Bug("usage-cached-tokens-of-the-first-choice-for-all", COMPLETIONS,
        '{"cached_tokens": sum(c.request.cached_tokens for c in choices)}}',
        '{"cached_tokens": choices[0].request.cached_tokens * len(choices)}}',
        (f"{METRIC_PAIRS}test_the_cached_tokens_of_several_choices_in_usage_are_those_the_prefix_cache_metrics_count",)),
    Bug("beam-steps-counted-per-row", "tserve/service/engine/translation.py",
        "            self._step_tokens += 1\n            finish = self.runner.append(req, token[id(req)])",
        "            self._step_tokens += len(req.rows)\n            finish = self.runner.append(req, token[id(req)])",
        (f"{METRIC_PAIRS}test_a_beam_request_batched_with_a_greedy_one_counts_one_token_a_step_not_one_a_row",)),
    Bug("preempted-request-observes-ttft-again", "tserve/service/engine/worker.py",
        "            self.waiting.appendleft(req)\n        self.m.preemptions.inc()",
        "            self.waiting.appendleft(req)\n        req.last_emit = 0.0\n        self.m.preemptions.inc()",
        (f"{METRIC_PAIRS}test_a_preempted_request_has_one_first_token_and_a_gap_before_each_later_one",)),
    Bug("chat-usage-prompt-tokens-once-for-n-choices", COMPLETIONS,
        '"usage": _usage(len(ids) * body.n, choices)}', '"usage": _usage(len(ids), choices)}',
        ("tests/engine/test_option_combinations_streaming.py::"
         "test_a_streamed_chat_of_several_choices_counts_each_choices_prompt",)),
    Bug("async-step-tokens-recorded-before-they-are-read", "tserve/service/engine/worker.py",
        "        self._read_tokens(still if self.running else None)\n        self._record_step_metrics()",
        "        self._record_step_metrics()\n        self._read_tokens(still if self.running else None)",
        ("tests/engine/test_async_scheduling.py::"
         "test_a_request_ended_by_max_tokens_is_not_stepped_again_and_one_ended_by_eos_is_once[layers]",)),
    Bug("streamed-document-usage-of-its-last-sentence", TRANSLATIONS,
        '"usage": _usage([doc], sum(len(s.token_ids) for s in done))}', '"usage": _usage([doc], len(done[-1].token_ids))}',
        ("tests/engine/test_option_combinations_translation_engine.py::"
         "test_a_greedy_document_of_several_sentences_streams_sentence_by_sentence",)),
    Bug("coalesced-event-keeps-only-the-later-token-ids", "tserve/service/engine/generation.py",
        "return Event(first.text + then.text, first.token_ids + then.token_ids, finish_reason=then.finish_reason)",
        "return Event(first.text + then.text, then.token_ids, finish_reason=then.finish_reason)",
        ("tests/engine/test_stream_coalescing.py::test_waiting_tokens_come_as_one_event_with_the_same_text_and_ids",)),
    # Settings that meet.
    Bug("model-name-given-twice-last-wins", "tserve/service/settings.py",
        "            if name in specs:\n                raise ValueError(f\"model name {name!r} given twice\")\n", "",
        (f"{SETTINGS}test_a_model_name_given_twice_is_refused_from_flags_and_from_the_environment",)),
    Bug("model-flag-default-hides-tserve-models", "tserve/service/cli.py",
        'parser.add_argument("--model", dest="models", action="append", metavar="NAME=PATH",',
        'parser.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=PATH",',
        (f"{SETTINGS}test_tserve_models_serves_when_no_model_flag_is_given_and_a_flag_replaces_it",)),
    Bug("chat-n-checked-against-max-prompts", COMPLETIONS,
        '    check_count("choices (n)", body.n, cfg.max_n)\n    try:\n        tools',
        '    check_count("choices (n)", body.n, cfg.max_prompts)\n    try:\n        tools', (MAX_N,)),
    Bug("prompts-times-n-against-max-prompts", COMPLETIONS,
        '    check_count("prompts", len(given), cfg.max_prompts)',
        '    check_count("prompts", len(given) * body.n, cfg.max_prompts)', (MAX_N,)),
    Bug("draft-model-not-quantized", "tserve/service/registry.py",
        "        draft = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend, quantize=s.quantize,\n",
        "        draft = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend,\n",
        ("tests/model/test_option_combinations_kernels.py::"
         "test_an_int4_group_size_reaches_the_served_model_and_its_draft",)),
    Bug("max-model-memory-counts-parameters-only", "tserve/model/quantize.py",
        "    tensors = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))\n",
        "    tensors = sum(t.numel() * t.element_size() for t in model.parameters())\n", (f"{HELD}[int4]",)),
    Bug("max-model-memory-without-int8s-packed-weights", "tserve/model/quantize.py",
        "    return tensors + sum(m.packed_bytes for m in model.modules() if isinstance(m, Int8Linear))",
        "    return tensors", (f"{HELD}[int8]",)),
    Bug("embedder-batch-size-is-max-running-requests", "tserve/service/served.py",
        'DynamicBatcher(f"{self.name}/embeddings", batch_fn, max_batch_size=s.batch_max_size,',
        'DynamicBatcher(f"{self.name}/embeddings", batch_fn, max_batch_size=s.max_running_requests,',
        (f"{URGENT}[/v1/embeddings]",)),
    Bug("translator-kv-block-size-default", SERVED_MT,
        "                                        kv_block_size=s.kv_block_size, async_scheduling=s.async_scheduling)",
        "                                        async_scheduling=s.async_scheduling)",
        (f"{SETTINGS}test_kv_block_size_reaches_the_language_model_and_the_translator",)),
    Bug("draft-shared-copy-not-reused", "tserve/service/registry.py",
        "        if (held := self._held_draft()) is not None:\n            return held\n", "",
        ("tests/engine/test_option_combinations_operations.py::"
         "test_the_draft_model_is_freed_with_the_last_model_that_drafts_with_it",)),
    Bug("admin-route-accepts-api-keys", "tserve/service/routes/repository.py",
        "KeyChecker(s.admin_keys).match(", "KeyChecker(s.admin_keys + s.api_keys).match(",
        ("tests/http/test_repository.py::test_index_admin_keys_and_loading_by_name",)),
    Bug("speculative-max-rows-is-max-running-requests", "tserve/service/generation/served.py",
        "max_rows=s.speculative_max_rows)", "max_rows=s.max_running_requests)",
        (f"{SETTINGS}test_no_drafts_while_more_rows_run_than_speculative_max_rows",)),
    # Conversations: two features across turns.
    Bug("cached-tokens-of-the-first-choice-only", COMPLETIONS,
        '"prompt_tokens_details": {"cached_tokens": sum(c.request.cached_tokens for c in choices)}}',
        '"prompt_tokens_details": {"cached_tokens": choices[0].request.cached_tokens}}',
        (f"{TURNS}test_each_choice_of_a_later_turn_counts_the_cached_blocks_it_read",)),
    Bug("prefix-names-include-the-last-token", BLOCK_POOL, "for i in range((len(token_ids) - 1) // bs):",
        "for i in range(len(token_ids) // bs):",
        ("tests/engine/test_paged_engine.py::test_outputs_with_the_prefix_cache_equal_outputs_without[layers]",)),
    Bug("earlier-call-id-dropped", SCHEMAS, 'out["tool_calls"] = [{"id": c.id, "type": "function", "function": {',
        'out["tool_calls"] = [{"type": "function", "function": {',
        (f"{TURNS}test_earlier_calls_reach_the_template_with_their_ids_as_transformers_renders_them",)),
    Bug("image-parts-silently-dropped", SCHEMAS, '    type: Literal["text"]\n    text: str\n',
        '    type: str\n    text: str = ""\n',
        (f"{TURNS}test_a_content_part_a_text_model_cannot_read_is_refused_not_dropped[image]",)),
    Bug("max-tokens-wins-over-max-completion-tokens", COMPLETIONS,
        "requested = body.max_completion_tokens or body.max_tokens", "requested = body.max_tokens or body.max_completion_tokens",
        ("tests/http/test_http_contract.py::test_chat_max_completion_tokens",)),
    Bug("auto-tools-drop-the-response-format", COMPLETIONS,
        "    if tools is not None and tools.constrained:\n        if constraint is not None:",
        '    if tools is not None and tools.mode != "none":\n        if constraint is not None and tools.constrained:',
        (f"{TURNS}test_a_response_format_on_a_later_turn_holds_when_tools_are_offered_too",)),
    Bug("admitted-table-counts-cached-blocks-as-tokens", BLOCK_POOL,
        "table = BlockTable(list(hits), list(names), len(hits) * self.block_size)",
        "table = BlockTable(list(hits), list(names), len(hits))",
        ("tests/model/test_paged_kv.py::test_a_cached_prefix_is_shared_and_gives_the_logits_of_a_fresh_computation",
         f"{TURNS}test_a_later_turn_reads_the_blocks_of_the_earlier_prompt_and_answer_and_an_edited_one_reads_none")),
    Bug("taken-block-keeps-its-name", BLOCK_POOL, "        name = self._name[block]\n        if name is not None:",
        "        name = self._name[block]\n        if name is not None and self._refs[block] > 0:",
        ("tests/engine/test_paged_engine.py::test_requests_preempted_by_a_small_pool_finish_as_they_would_alone[fused]",)),
    Bug("assistant-call-without-content-refused", SCHEMAS,
        'if self.content is None and not (self.role == "assistant" and self.tool_calls):', "if self.content is None:",
        ("tests/engine/test_option_combinations_chat.py::"
         "test_a_conversation_with_a_call_and_its_answer_reaches_the_template_as_transformers_passes_it",)),
    Bug("async-answer-blocks-never-named", RUNNER,
        "known = min(seq.num_computed, len(seq.prompt_ids) + len(seq.generated))",
        "known = min(seq.num_computed, len(seq.prompt_ids))",
        ("tests/engine/test_async_scheduling.py::"
         "test_blocks_filled_by_tokens_fed_from_the_device_are_found_by_a_follow_up_prompt[layers]",)),
    # Fixed: vLLM's chat options read, not ignored.
    Bug("continue-final-message-ignored", COMPLETIONS, "            continue_final_message=body.continue_final_message)",
        "            continue_final_message=False)",
        (f"{TURNS}test_a_reply_whose_start_is_given_goes_on_from_it",)),
    Bug("continued-message-loses-its-trailing-space", "tserve/model/chat_template.py",
        "    if rendered[at:at + len(final.lstrip())] == final.lstrip():\n", "    if False:\n",
        ("tests/model/test_option_combinations_tokenizers.py::"
         "test_a_chat_left_open_or_without_a_generation_prompt_renders_as_transformers_renders_it[hf-qwen2]",)),
    # Legacy completions: several prompts, choices, seeds, echo and logprobs at once.
    Bug("completions-seed-offset-counts-across-prompts", COMPLETIONS,
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, j, body.logprobs, bias, grammar)) for ids in encoded\n"
        "            for j in range(body.n)]",
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, p * body.n + j, body.logprobs, bias, grammar))\n"
        "            for p, ids in enumerate(encoded) for j in range(body.n)]", (f"{AS_ALONE}[seed-21]",)),
    Bug("completions-jobs-choice-major", COMPLETIONS,
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, j, body.logprobs, bias, grammar)) for ids in encoded\n"
        "            for j in range(body.n)]",
        "    jobs = [(ids, _sampling(body, body.max_tokens or 16, j, body.logprobs, bias, grammar)) for j in range(body.n)\n"
        "            for ids in encoded]", (f"{AS_ALONE}[seed-21]",)),
    Bug("choice-prompt-read-choice-major", COMPLETIONS, "        p = i // body.n\n", "        p = i % len(prompts)\n",
        (f"{AS_ALONE}[seed-21]",)),
    Bug("echo-offsets-from-the-first-prompt", COMPLETIONS, "served.tokenizer.decode(encoded[p][:k], skip",
        "served.tokenizer.decode(encoded[0][:k], skip", (ECHOED_LOGPROBS,)),
    Bug("echo-offsets-where-tokens-end", COMPLETIONS, "for k in range(len(echo_logprobs[p]))]",
        "for k in range(1, len(echo_logprobs[p]) + 1)]", (ECHOED_LOGPROBS,)),
    Bug("echo-prefix-of-the-first-prompt", COMPLETIONS, 'Choice(i, req, prompts[p] if body.echo else ""',
        'Choice(i, req, prompts[0] if body.echo else ""', (f"{AS_ALONE}[seed-21]",)),
    Bug("streamed-echo-once-per-prompt", COMPLETIONS, "            for c in choices:\n                if c.prefix:",
        "            for c in choices[:: body.n]:\n                if c.prefix:",
        (f"{LEGACY}test_a_streamed_list_of_prompts_with_n_and_echo_streams_each_choice_under_its_own_index",)),
    Bug("usage-prompt-tokens-of-the-first-prompt", COMPLETIONS, "prompt_tokens = sum(len(ids) for ids in encoded)",
        "prompt_tokens = len(encoded[0]) * len(prompts)", (f"{AS_ALONE}[seed-21]",)),
    Bug("context-check-skips-later-prompts", COMPLETIONS, "for ids, params in jobs[:: body.n]:",
        "for ids, params in jobs[: len(prompts)]:",
        (f"{LEGACY}test_a_later_prompt_past_the_context_is_refused_whatever_the_n_and_echo[echo-logprobs]",)),
    Bug("score-prompt-reads-the-next-positions-logits", "tserve/service/engine/generation.py",
        "logits = self.model(tokens)[0, :-1].float()", "logits = self.model(tokens)[0, 1:].float()",
        (ECHOED_LOGPROBS,)),
    Bug("seed-0-with-n-unseeded", COMPLETIONS, "seed=None if body.seed is None else (body.seed + seed_offset) % 2**63,",
        "seed=(body.seed + seed_offset) % 2**63 if body.seed else None,", (f"{AS_ALONE}[seed-0]",)),
    Bug("echo-prompt-alternatives-capped-at-one", COMPLETIONS,
        "served.score_prompt, ids,\n                                           body.logprobs)",
        "served.score_prompt, ids,\n                                           min(body.logprobs, 1))", (ECHOED_LOGPROBS,)),
    # Fixed: OpenAI's other prompt forms served; what is not served refused.
    Bug("token-id-prompts-read-as-one-prompt-each-id", COMPLETIONS,
        "    given = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt\n",
        "    given = [body.prompt] if isinstance(body.prompt, str) else body.prompt\n", (TOKEN_PROMPTS,)),
    Bug("token-id-prompts-outside-the-vocabulary", COMPLETIONS, "    if bad := [i for i in ids if not 0 <= i < vocab_size]:",
        "    if bad := [i for i in ids if i < 0]:", (TOKEN_PROMPTS,)),
    Bug("suffix-ignored", COMPLETIONS, "    if body.suffix:\n", "    if False:\n",
        (f"{LEGACY}test_suffix_and_a_best_of_beyond_n_are_refused_not_ignored",)),
    # Fixed: a replaced model's drain beside the name's gauges.
    Bug("replaced-workers-keep-writing-gauges", "tserve/service/registry.py",
        "                for worker in old.workers:\n                    worker.replaced()\n", "",
        (REPLACED,)),
    Bug("replaced-metrics-drop-the-counters", "tserve/service/metrics.py",
        "        child = _UNREPORTED if isinstance(metric, Gauge) else metric.labels(self._name)",
        "        child = _UNREPORTED", (REPLACED,)),
]
