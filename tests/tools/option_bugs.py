"""Planted bugs where options meet, a second survey: the served model's and the draft model's quantization options
and the fused step's paths (`tests/model/test_option_combinations_kernels.py`); asynchronous scheduling with logprobs,
preemption with the prefix cache and the queue's order, identical prompts at once, call jobs with --max-queue 0, a
fractional KV budget beside a sliding pool, a translator's admission in a small pool and a request's choices toward
--max-queue (`tests/engine/test_option_combinations_scheduling.py`); streamed against unstreamed answers under echo,
logprobs, several choices, stop strings at the last token and chat messages' parts and names
(`tests/engine/test_option_combinations_streaming.py`); LibreTranslate's lists, forms, detection and limits, the Open
Inference Protocol's limits and beams, embeddings beside several models, CORS with API keys and a model unloaded and
loaded again (`tests/http/test_option_combinations_compat.py`); each file format's escapes, cues, tables, footers and
master pages, file jobs with the translation memory, max_tokens, pivots and glossaries, and `/translate_file` with
`auto` (`tests/files/test_option_combinations_files.py`); the families' importers where a config leaves its fixture's
default, the backends, and Gemma's norms and embedding scale in bfloat16
(`tests/model/test_option_combinations_families.py`); what an operator sees where options meet: refusals by middleware,
route labels, sizes from flags and the environment, the OTLP endpoint, failed spans, the log level, the drain
(`tests/http/test_option_combinations_observability.py`); each row's temperature, top-k and top-p, logprobs beside the
constraints, several eos ids, a grammar beside min_tokens and beams that never stop early
(`tests/model/test_option_combinations_sampling.py`); training continued, validated and recorded for every model kind,
evaluation's quantized figures, limits and cards (`tests/training/test_option_combinations_training.py`), beside the module tests named. Part of
`tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

KERNELS = "tests/model/test_option_combinations_kernels.py::"
FUSED = "tests/model/test_fused_decode.py::test_fused_steps_equal_the_layers_steps"
SERVED_LOAD = "quantize=s.quantize,\n                                 int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,"
DRAFT_LOAD = "quantize=s.quantize,\n                                int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,"
GROUP_SIZE = f"{KERNELS}test_an_int4_group_size_reaches_the_served_model_and_its_draft"
ACTIVATIONS = f"{KERNELS}test_int8_activations_reach_the_served_model_and_its_draft"
SCHED = "tests/engine/test_option_combinations_scheduling.py::"
STREAM = "tests/engine/test_option_combinations_streaming.py::"
EVERY_COMBINATION = f"{STREAM}test_a_streamed_completion_is_the_unstreamed_one_under_every_combination"
C = "tserve/service/routes/completions.py"
LT = "tserve/service/routes/libretranslate.py"
COMPAT = "tests/http/test_option_combinations_compat.py::"
RELOADED = f"{COMPAT}test_a_translator_unloaded_and_loaded_again_leaves_and_rejoins_libretranslates_routes"
FORM = f"{COMPAT}test_a_form_body_takes_alternatives_and_a_repeated_q_as_a_list"
V2_LIMITS = f"{COMPAT}test_a_language_models_v2_requests_keep_max_tokens_limit_and_max_input_chars"
FILES = "tests/files/test_option_combinations_files.py::"
FAMILIES = "tests/model/test_option_combinations_families.py::"
LLAMA_FAMILY = "tests/model/test_llama_family.py::"
OBS = "tests/http/test_option_combinations_observability.py::"
REFUSED_FOR_KEY = f"{OBS}test_a_request_refused_for_its_key_is_counted_logged_and_carries_its_request_id"
ROUTE_LABEL = f"{OBS}test_the_route_label_stays_bounded_for_unknown_paths_and_templated_routes"
ERROR_SHAPES = f"{OBS}test_errors_keep_each_route_familys_shape_and_headers"
OTLP = f"{OBS}test_the_otlp_flag_wins_over_the_environment_and_a_full_traces_url_is_kept"
DRAIN = f"{OBS}test_a_drain_ends_at_its_timeout_and_a_second_signal_stops_at_once"
FAILED_SPANS = f"{OBS}test_every_5xx_marks_the_requests_span_failed_and_a_4xx_does_not"
SAMPLING = "tests/model/test_option_combinations_sampling.py::"
MIXED_BATCH = f"{SAMPLING}test_each_row_is_tempered_before_its_top_k_and_top_p_in_a_mixed_batch"
CONSTRAINED_LOGPROBS = f"{SAMPLING}test_reported_logprobs_are_the_constrained_distributions_before_temperature"
EOS_IDS = f"{SAMPLING}test_ignore_eos_and_min_tokens_ban_every_eos_id_of_the_checkpoint"
LOGITS = "tserve/model/decoding/logits.py"
TRAINING = "tests/training/test_option_combinations_training.py::"
EVALUATE = "tserve/training/evaluate.py"
QUANTIZED_FIGURES = f"{TRAINING}test_each_quantized_format_is_stored_under_its_own_key_and_survives_a_float32_evaluation"
LIMITED = f"{TRAINING}test_quantized_lm_figures_on_a_limited_split_are_those_of_the_same_texts"
CONTINUED = f"{TRAINING}test_every_model_kind_continued_with_a_new_dropout_validates_its_start_and_records_the_run"
DE_EN = f"{TRAINING}test_a_german_to_english_translator_is_validated_and_continued_german_to_english"
AMPERSAND = f"{FILES}test_an_ampersand_comes_back_as_the_character_each_format_writes_it_as"
PIVOTED_FILE = f"{FILES}test_a_pivoted_file_is_the_second_models_translation_of_the_first_ones"
ROUTE_FILES = "tserve/service/routes/files.py"
TEXT_FILES = "tserve/service/translation/files/text_files.py"
MARKDOWN = "tserve/service/translation/files/markdown.py"
KEYS_BEFORE_CORS = ('    app.state.key_gate = gate = KeyGate(settings.api_keys, settings.max_requests_per_key)\n'
                    '    app.add_middleware(APIKeyMiddleware, gate=gate, public_paths=settings.public_paths,\n'
                    '                       self_checked_paths=libretranslate.KEY_CHECKED_PATHS,\n'
                    "                       # the admin keys and a download's owner key are checked there\n"
                    '                       self_checked_prefixes=(repository.PREFIX + "/", libretranslate.DOWNLOAD_PREFIX))\n')
CONTEXT = "    app.add_middleware(RequestContextMiddleware, metrics=metrics)\n"
CORS = ('    if settings.cors_origins:\n'
        '        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],\n'
        '                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"])\n')
PREEMPTED_ORDER = f"{SCHED}test_the_newest_running_request_gives_way_and_comes_back_before_later_arrivals"

OPTION_BUGS = [
    Bug("served-model-int4-group-size-ignored", "tserve/service/registry.py", SERVED_LOAD,
        "quantize=s.quantize,\n                                 int8_activations=s.int8_activations,", (GROUP_SIZE,)),
    Bug("served-model-int8-activations-ignored", "tserve/service/registry.py", SERVED_LOAD,
        "quantize=s.quantize,\n                                 int4_group_size=s.int4_group_size,", (ACTIVATIONS,)),
    Bug("draft-model-int4-group-size-default", "tserve/service/registry.py", DRAFT_LOAD,
        "quantize=s.quantize,\n                                int8_activations=s.int8_activations,", (GROUP_SIZE,)),
    Bug("draft-model-int8-activations-default", "tserve/service/registry.py", DRAFT_LOAD,
        "quantize=s.quantize,\n                                int4_group_size=s.int4_group_size,", (ACTIVATIONS,)),
    Bug("draft-model-loaded-unfused", "tserve/service/registry.py",
        "\n                                pack_weights=True, fused_layers=s.fused_layers)",
        "\n                                pack_weights=True)",
        (f"{KERNELS}test_fused_layers_fuse_the_draft_models_steps_as_the_served_models",)),
    Bug("draft-model-in-float32-beside-a-bfloat16-model", "tserve/service/registry.py",
        "draft = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend,",
        "draft = checkpoint.load(path, device=device, backend=backend,",
        (f"{KERNELS}test_a_bfloat16_model_drafts_with_a_bfloat16_draft",)),
    Bug("fused-step-without-a-kernel-path", "tserve/model/fused_decode.py",
        "    if cpu_kernels.kernel_isa() is None:", "    if False:",
        (f"{KERNELS}test_a_float32_model_does_not_fuse_where_the_kernels_have_no_path",)),
    Bug("fused-nope-layers-rotated", "tserve/model/fused_decode.py",
        'rotates = cfg.positions == "rope" and attn.rotates', 'rotates = cfg.positions == "rope"',
        (f"{FUSED}[phi3-smollm3-granite-float32]",)),
    Bug("fused-output-layer-kind-of-the-last-down-product", "tserve/model/fused_decode.py",
        "ints += [output[0], output[1]]", "ints += [down[0], output[1]]", (f"{FUSED}[gemma3-q4_0]",)),
    Bug("fused-every-layer-takes-the-sliding-window", "tserve/model/fused_decode.py",
        "attn.window or 0]", "cfg.sliding_window or 0]", (f"{FUSED}[gemma3-float32]",)),
    Bug("quantized-models-never-fused", "tserve/model/checkpoint.py",
        'quantized["fused_layers"] = loaded.model.fused is not None or loaded.model.fuse_decode()',
        'quantized["fused_layers"] = loaded.model.fused is not None',
        ("tests/model/test_option_combinations_models.py::test_granites_fused_decode_steps_keep_its_embedding_"
         "multiplier_and_logits_scaling[q8_0]",)),
    Bug("async-logprobs-misaligned-after-a-dropped-row", "tserve/service/engine/worker.py",
        "None if logprobs is None else tuple([x[i] for i in live] for x in logprobs))", "logprobs)",
        (f"{SCHED}test_logprobs_of_an_overlapped_step_stay_with_their_rows_when_an_earlier_row_ended_by_eos",)),
    Bug("readmitted-request-reports-its-own-blocks-as-cached", "tserve/model/decoding/lm_runner.py",
        "        if seq.next_token is None:  # first admission (not a preempted sequence coming back)\n"
        "            seq.cached_tokens = seq.table.num_cached_tokens",
        "        seq.cached_tokens = seq.table.num_cached_tokens",
        (f"{SCHED}test_a_preempted_request_reports_the_prompt_tokens_its_first_admission_read_from_the_cache",)),
    Bug("preemption-takes-the-oldest-request", "tserve/service/engine/generation.py",
        "victim = next(r for r in reversed(order) if r.table is not None)",
        "victim = next(r for r in order if r.table is not None)", (PREEMPTED_ORDER,)),
    Bug("preempted-request-requeued-behind-later-arrivals", "tserve/service/engine/worker.py",
        "            self.waiting.appendleft(req)", "            self.waiting.append(req)", (PREEMPTED_ORDER,)),
    Bug("max-queue-0-counts-rows-for-call-jobs", "tserve/service/engine/worker.py",
        "        return 0 if isinstance(req, CallRequest) else self._rows_needed(req)",
        "        return self._rows_needed(req)", (f"{SCHED}test_with_max_queue_0_a_call_job_is_taken_while_every_row_is_busy",)),
    Bug("fractional-kv-budget-ignores-the-sliding-pool", "tserve/service/engine/kv_memory.py",
        "        size = int(fraction * free_memory(loaded.device)) - reserved",
        "        size = int(fraction * free_memory(loaded.device))",
        (f"{SCHED}test_a_fractional_kv_cache_budget_pays_for_the_sliding_layers_pool_as_a_byte_budget_does",)),
    Bug("identical-prompts-admitted-together-compute-the-prefix-twice", "tserve/model/decoding/lm_runner.py",
        "        if names[hits:hits + 1] and names[hits] in self._pending:\n"
        "            return False  # a sequence admitted before it computes this very block now: wait and read it\n", "",
        (f"{SCHED}test_identical_prompts_sent_at_once_compute_the_prompt_once_and_the_others_read_it",)),
    Bug("translation-admission-leaves-no-spare-blocks", "tserve/service/engine/translation.py",
        "self.runner.reserve(req, spare=self.runner.blocks_for_next_step(self.running))", "self.runner.reserve(req)",
        (f"{SCHED}test_a_translation_admitted_into_a_small_pool_is_not_preempted_at_the_step_that_admits_it",)),
    Bug("async-speculative-steps-draft-from-unread-tokens", "tserve/service/engine/generation.py",
        "        if not self.overlap or self.runner.speculation is not None or any(",
        "        if not self.overlap or any(",
        ("tests/engine/test_async_scheduling.py::test_preemption_speculation_and_cancelled_clients_stream_what_the_"
         "synchronous_engine_streams[layers]",)),
    Bug("a-requests-choices-each-count-toward-max-queue", "tserve/service/engine/worker.py",
        "group=group, turn=turn if one_request else first_turn))",
        "group=group if one_request else object(), turn=turn if one_request else first_turn))",
        (f"{SCHED}test_a_requests_choices_and_prompts_count_once_toward_max_queue",)),
    Bug("chat-streamed-usage-counts-one-choices-prompt", C,
        "usage = (lambda: _usage(len(ids) * body.n, choices)) if include_usage else None",
        "usage = (lambda: _usage(len(ids), choices)) if include_usage else None",
        (f"{STREAM}test_a_streamed_chat_of_several_choices_counts_each_choices_prompt",)),
    Bug("streamed-echo-with-logprobs-0-drops-the-prompts-logprobs", C,
        "lp = c.logprobs_dict(served.tokenizer) if body.logprobs is not None else None\n                    yield",
        "lp = c.logprobs_dict(served.tokenizer) if body.logprobs else None\n                    yield",
        (f"{EVERY_COMBINATION}[llama]", f"{EVERY_COMBINATION}[mistral]")),
    Bug("streamed-chat-logprobs-only-with-top-logprobs", C,
        "lp = _chat_logprobs(event.logprobs) if body.logprobs else None",
        "lp = _chat_logprobs(event.logprobs) if body.top_logprobs else None",
        (f"{STREAM}test_streamed_chat_logprobs_are_the_unstreamed_ones[logprobs-alone]",)),
    Bug("stop-string-on-the-last-allowed-token-finishes-with-length", "tserve/service/engine/output.py",
        '        if stopped:\n            finish = "stop"', '        if stopped and finish is None:\n            finish = "stop"',
        (f"{STREAM}test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop",)),
    Bug("detokenizer-starts-without-the-prompt", "tserve/service/engine/generation.py",
        "IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids)", "IncrementalDetokenizer(self.tokenizer)",
        (f"{EVERY_COMBINATION}[mistral]",)),
    Bug("chat-default-max-tokens-ignores-the-prompt", C,
        "max(1, min(cfg.max_tokens_limit, served.max_len - len(ids)))", "max(1, min(cfg.max_tokens_limit, served.max_len))",
        (f"{STREAM}test_a_chat_without_max_tokens_writes_up_to_the_end_of_the_context",)),
    Bug("content-parts-keep-only-the-first", "tserve/service/request_schemas.py",
        'else "\\n".join(p.text for p in self.content)}', "else self.content[0].text}",
        (f"{STREAM}test_a_message_of_text_parts_is_the_message_of_their_joined_text",)),
    Bug("message-name-not-passed-to-the-template", "tserve/service/request_schemas.py",
        'for key in ("tool_call_id", "name"):', 'for key in ("tool_call_id",):',
        (f"{STREAM}test_a_participants_name_and_a_system_message_reach_the_template",)),
    Bug("libretranslate-list-of-one-answered-as-a-string", LT,
        '{"translatedText": translated if batch else translated[0]}',
        '{"translatedText": translated if len(texts) > 1 else translated[0]}',
        (f"{COMPAT}test_a_libretranslate_list_of_one_text_is_answered_as_a_list",)),
    Bug("libretranslate-form-alternatives-taken-as-text", LT,
        "    if isinstance(value, str) and value.strip().isdigit():  # a form sends every field as text\n"
        "        value = int(value)\n", "", (FORM,)),
    Bug("libretranslate-repeated-form-field-keeps-the-last", LT,
        "fields[name] = values if len(values) > 1 else values[0]", "fields[name] = values[-1]", (FORM,)),
    Bug("libretranslate-auto-detects-among-the-sources-only", LT,
        "detected = await _detect(texts, sorted({s for s, _ in pairs} | {target}))",
        "detected = await _detect(texts, sorted({s for s, _ in pairs}))", (RELOADED,)),
    Bug("libretranslate-batch-limit-checked-per-language", LT,
        "            check_count(len(texts), settings(request))\n", "            check_count(1, settings(request))\n",
        (f"{COMPAT}test_a_libretranslate_batch_past_max_prompts_is_refused_even_when_detection_splits_it",)),
    Bug("oip-lm-max-tokens-past-the-server-limit", "tserve/service/generation/served.py",
        '        high = max_tokens_limit if name == "max_tokens" else high\n', "", (V2_LIMITS,)),
    Bug("oip-lm-prompts-past-max-input-chars", "tserve/service/generation/served.py",
        "ids = self.loaded.tokenizer.encode(text) if text and len(text) <= limit else []",
        "ids = self.loaded.tokenizer.encode(text) if text else []", (V2_LIMITS,)),
    Bug("oip-translator-num-beams-ignored", "tserve/service/translation/served.py",
        'ask = TranslationAsk(texts, params.get("num_beams"), None, n,', "ask = TranslationAsk(texts, None, None, n,",
        (f"{COMPAT}test_a_translators_v2_num_beams_parameter_allows_more_alternatives_than_its_default",)),
    Bug("oip-pixel-batch-unbounded", "tserve/service/vision/served.py",
        'if not 1 <= tensor["shape"][0] <= limits.max_prompts:', 'if not 1 <= tensor["shape"][0]:',
        (f"{COMPAT}test_a_v2_pixel_batch_is_held_to_max_prompts",)),
    Bug("embeddings-without-model-count-every-embedding-model", "tserve/service/routes/embeddings.py",
        "candidates = [m for m in registry.models.values() if m.embeds == kind]",
        "candidates = [m for m in registry.models.values() if m.embeds]",
        (f"{COMPAT}test_image_embeddings_without_a_model_go_to_the_only_image_model_beside_text_ones",)),
    Bug("cors-behind-the-api-keys", "tserve/service/app.py", KEYS_BEFORE_CORS + CORS, CORS + KEYS_BEFORE_CORS,
        (f"{COMPAT}test_cors_preflights_and_refusals_pass_in_front_of_api_keys",)),
    Bug("index-forgets-unloaded-models-outside-the-repository", "tserve/service/routes/repository.py",
        "names = sorted(set(reg.models) | set(reg.states) | set(_repository_models(request)))",
        "names = sorted(set(reg.models) | set(_repository_models(request)))", (RELOADED,)),
    Bug("unload-keeps-the-derived-routes", "tserve/service/registry.py",
        "            self._retiring.append(self.models.pop(name))\n            self._changed()\n",
        "            self._retiring.append(self.models.pop(name))\n", (RELOADED,)),
    Bug("file-jobs-ignore-cache-false", ROUTE_FILES,
        "rendered = await hop[0].translate_blocks(hop_doc, current.escape, ask.cache, job.progress)",
        "rendered = await hop[0].translate_blocks(hop_doc, current.escape, True, job.progress)",
        (f"{FILES}test_a_warm_memory_gives_a_file_the_same_runs_and_cache_false_translates_it_again",)),
    Bug("pivoted-file-last-hop-drops-glossary", ROUTE_FILES,
        "    asks = [first_ask, *(replace(hop_ask(ask, hop, [], k == len(hops) - 1), markups=[fdoc.markup])",
        "    asks = [first_ask, *(replace(hop_ask(ask, hop, [], False), markups=[fdoc.markup])",
        (f"{FILES}test_a_pivoted_files_glossary_is_placed_by_its_last_hop",)),
    Bug("pivoted-file-job-names-the-pivot-as-target", ROUTE_FILES,
        "languages = (first_ask.source_lang, hops[-1][1][1] if len(hops) > 1 else first_ask.target_lang)",
        "languages = (first_ask.source_lang, first_ask.target_lang)", (PIVOTED_FILE,)),
    Bug("pivoted-files-second-hop-reads-the-source", ROUTE_FILES,
        "(hop_doc,) = hop[0].documents(replace(asks[k], markups=[current.markup]), hop_languages[k])",
        "(hop_doc,) = hop[0].documents(replace(asks[k], markups=[fdoc.markup]), hop_languages[k])", (PIVOTED_FILE,)),
    Bug("file-jobs-drop-max-tokens", ROUTE_FILES,
        'ask = TranslationAsk([], _form_int(form, "num_beams"), _form_int(form, "max_tokens"), 1, terms, False,',
        'ask = TranslationAsk([], _form_int(form, "num_beams"), None, 1, terms, False,',
        (f"{FILES}test_a_file_jobs_max_tokens_bounds_each_sentence[txt]",)),
    Bug("srt-text-html-escaped", TEXT_FILES, "    escape = (lambda s: html.escape(s, quote=False)) if vtt else no_escape\n",
        "    escape = lambda s: html.escape(s, quote=False)\n", (f"{AMPERSAND}[srt]",)),
    Bug("office-text-html-escaped", "tserve/service/translation/files/xml_parts.py",
        "return FileDocument(Markup([p.block for p, _ in self.paragraphs]), lambda text: text, self.write, media_type)",
        "return FileDocument(Markup([p.block for p, _ in self.paragraphs]), None, self.write, media_type)",
        (f"{AMPERSAND}[docx]", f"{AMPERSAND}[odt]")),
    Bug("subtitle-cue-rewrapped-in-two-lines", TEXT_FILES, "    for k in range(1, lines):\n",
        "    for k in range(1, min(lines, 2)):\n", (f"{FILES}test_a_subtitle_cue_of_three_lines_comes_back_in_three[srt]",)),
    Bug("markdown-hard-break-in-quote-loses-prefix", MARKDOWN,
        'prefix = lines[found[1][0]][: found[1][1]] if len(found) > 1 else ""', 'prefix = ""',
        (f"{FILES}test_a_markdown_hard_break_inside_a_quote_or_a_list_item_keeps_the_line_in_it",)),
    Bug("markdown-table-cells-of-one-text-overlap", MARKDOWN,
        "at = lines[n].find(content_line.strip(), cursor.get(n, 0))", "at = lines[n].find(content_line.strip())",
        (f"{FILES}test_markdown_table_cells_of_the_same_text_on_one_row_are_each_translated",)),
    Bug("docx-footers-untranslated", "tserve/service/translation/files/ooxml.py",
        'DOCX_PARTS = re.compile(r"word/(document|header\\d*|footer\\d*|footnotes|endnotes|comments)\\.xml")',
        'DOCX_PARTS = re.compile(r"word/(document|header\\d*|footnotes|endnotes|comments)\\.xml")',
        (f"{FILES}test_a_word_footer_is_translated_like_its_header",)),
    Bug("odt-master-page-headers-untranslated", "tserve/service/translation/files/odf.py",
        '    for name in ("content.xml", "styles.xml"):', '    for name in ("content.xml",):',
        (f"{FILES}test_an_opendocument_master_pages_header_and_footer_are_translated",)),
    Bug("epub-title-entities-escaped-twice", "tserve/service/translation/files/epub.py",
        "element.text = html.unescape(text)  # rendered as HTML; lxml escapes it again", "element.text = text",
        (f"{AMPERSAND}[epub]",)),
    Bug("libretranslate-file-auto-source-taken-as-a-language", LT,
        "ask = TranslationAsk([], None, None, 1, None, False, None if auto else source, target)",
        "ask = TranslationAsk([], None, None, 1, None, False, source, target)",
        (f"{FILES}test_libretranslate_detects_an_auto_source_file_and_routes_it_through_the_pivot",)),
    Bug("xml-entities-in-wide-encodings-parsed", "tserve/service/translation/files/containers.py",
        "    if dtd is not None and next(iter(dtd.iterentities()), None) is not None:\n        raise refused\n", "",
        ("tests/files/test_formats.py::test_xml_entity_declarations_are_refused",)),
    Bug("streamed-calls-cut-by-max-tokens-finish-with-length", "tserve/service/generation/tool_calls.py",
        'return out, ("tool_calls" if calls else finish_reason)',
        'return out, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)',
        ("tests/http/test_tool_call_parsing.py::test_calls_then_text_cut_by_max_tokens_finish_with_tool_calls_streamed_as_"
         "unstreamed",)),
    Bug("embeddings-texts-past-max-input-chars", "tserve/service/routes/embeddings.py",
        '        for i, text in enumerate(texts):\n            check_chars(text, cfg.max_input_chars, f"input {i}")\n', "",
        (f"{COMPAT}test_max_input_chars_bounds_embeddings_texts_and_language_detection",)),
    Bug("detect-q-past-max-input-chars", LT,
        '            check_input_chars(q, settings(request).max_input_chars, "q")\n',
        '            pass\n', (f"{COMPAT}test_max_input_chars_bounds_embeddings_texts_and_language_detection",)),
    Bug("content-parts-joined-without-a-line-break", "tserve/service/request_schemas.py",
        'else "\\n".join(p.text for p in self.content)}', 'else "".join(p.text for p in self.content)}',
        (f"{STREAM}test_a_message_of_text_parts_is_the_message_of_their_joined_text",)),
    Bug("held-back-tokens-offset-at-the-sent-text", C,
        "own = event.text_start if event.text_start is not None else len(self.text)", "own = len(self.text)",
        (f"{STREAM}test_tokens_held_back_by_a_possible_stop_string_keep_their_own_text_offsets",)),
    Bug("qwen3-output-projection-bias-dropped", "tserve/model/importers/qwen3.py",
        "qkv_bias=bias, out_bias=bias, qk_norm=True", "qkv_bias=bias, out_bias=False, qk_norm=True",
        (f"{FAMILIES}test_attention_biases_on_the_query_key_value_and_output_projections_equal_transformers[qwen3]",)),
    Bug("granite-untied-output-read-as-tied", "tserve/model/importers/granite.py",
        'raw = {"tie_word_embeddings": True} | raw', 'raw = raw | {"tie_word_embeddings": True}',
        (f"{FAMILIES}test_an_untied_output_layer_is_read_in_families_whose_fixtures_tie_it[granite]",)),
    Bug("longrope-default-factor-inverted", "tserve/model/importers/llama.py",
        'scaling["factor"] = raw["max_position_embeddings"] / original',
        'scaling["factor"] = original / raw["max_position_embeddings"]',
        (f"{LLAMA_FAMILY}test_longrope_past_the_original_context_equals_transformers",)),
    Bug("smollm3-default-nope-layers-shifted", "tserve/model/importers/smollm3.py",
        "flags = [int((i + 1) % interval != 0)", "flags = [int(i % interval != 0)",
        (f"{FAMILIES}test_smollm3_without_no_rope_layers_leaves_every_intervalth_layer_without_positions",)),
    Bug("gemma-offset-norm-in-half-precision", "tserve/model/norms.py",
        "return (normed * (self.offset + self.weight.float())).to(x.dtype)",
        "return normed.to(x.dtype) * (self.offset + self.weight)",
        (f"{FAMILIES}test_gemmas_offset_norms_in_bfloat16_are_transformers_bit_for_bit[gemma2]",)),
    Bug("mistral-window-only-with-layer-types", "tserve/model/importers/mistral.py", "default_all=True",
        "default_all=False", (f"{FAMILIES}test_mistral_slides_every_layer_when_its_config_sets_a_window_without_layer_types",)),
    Bug("t5-num-decoder-layers-ignored", "tserve/model/importers/t5.py",
        'n_decoder_layers=raw.get("num_decoder_layers") or raw["num_layers"]', 'n_decoder_layers=raw["num_layers"]',
        (f"{FAMILIES}test_a_t5_decoder_of_its_own_depth_reads_every_layer",)),
    Bug("dynamic-rope-base-of-p-tokens", "tserve/model/rope.py", "factor * (later + 1) / trained",
        "factor * later / trained",
        (f"{LLAMA_FAMILY}test_dynamic_rope_tables_are_transformers_for_each_sequence_length",)),
    Bug("tokenizer-eos-wins-over-generation-eos-list", "tserve/model/decoding/lm_runner.py",
        "self.eos_ids = set(gen.eos_token_ids or ([] if eos is None else [eos]))",
        "self.eos_ids = {eos} if eos is not None else set(gen.eos_token_ids)",
        (f"{LLAMA_FAMILY}test_every_eos_id_stops",)),
    Bug("gemma2-hub-config-slides-five-of-six", "tserve/model/importers/gemma.py",
        'pattern = 2 if raw["model_type"] == "gemma2" else int(raw.get("sliding_window_pattern", 6))',
        'pattern = int(raw.get("sliding_window_pattern", 6))',
        (f"{FAMILIES}test_gemma2_configs_without_layer_types_slide_every_other_layer",)),
    Bug("softcap-dropped-on-the-math-backend", "tserve/model/attention.py",
        "        if self.softcap is not None:  # no fused kernel caps the scores",
        '        if self.softcap is not None and name != "math":  # no fused kernel caps the scores',
        (f"{FAMILIES}test_every_cpu_backend_computes_each_familys_attention[gemma2-math]",)),
    Bug("gemma-embedding-scale-unrounded-in-half-precision", "tserve/model/decoder.py",
        "if self.cfg.scale_embeddings and x.dtype != torch.float32:", "if False:",
        (f"{FAMILIES}test_gemmas_embedding_scale_in_bfloat16_is_rounded_as_transformers_rounds_it[gemma3]",)),
    Bug("auth-refusals-outside-the-request-context", "tserve/service/app.py", KEYS_BEFORE_CORS + CORS + CONTEXT,
        CONTEXT + KEYS_BEFORE_CORS + CORS, (REFUSED_FOR_KEY,)),
    Bug("unmatched-routes-labelled-by-their-path", "tserve/service/app.py",
        'route = getattr(scope.get("route"), "path", "unmatched")',
        'route = getattr(scope.get("route"), "path", scope["path"])', (ROUTE_LABEL,)),
    Bug("routes-labelled-by-their-concrete-path", "tserve/service/app.py",
        'route = getattr(scope.get("route"), "path", "unmatched")',
        'route = scope["path"] if scope.get("route") else "unmatched"', (ROUTE_LABEL,)),
    Bug("translate-file-errors-in-openai-shape", "tserve/service/errors.py",
        '"/frontend/settings", "/translate_file"})', '"/frontend/settings"})', (ERROR_SHAPES,)),
    Bug("http-error-headers-dropped", "tserve/service/errors.py",
        'type_, None, getattr(exc, "headers", None)))', "type_, None, None))", (ERROR_SHAPES,)),
    Bug("middleware-refusals-in-openai-shape-everywhere", "tserve/service/errors.py",
        "    path = request.url.path if request is not None else path\n",
        "    path = request.url.path if request is not None else None\n",
        (f"{OBS}test_the_middlewares_refusals_keep_each_route_familys_shape",)),
    Bug("gib-read-as-gb", "tserve/service/settings.py", '"gib": 2**30,', '"gib": 10**9,',
        (f"{OBS}test_sizes_are_read_the_same_from_a_flag_and_from_the_environment[2GiB-2147483648]",)),
    Bug("otlp-environment-wins-over-the-flag", "tserve/service/tracing.py",
        'endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")',
        'endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or endpoint', (OTLP,)),
    Bug("otlp-traces-path-appended-twice", "tserve/service/tracing.py",
        'url = url if url.endswith("/v1/traces") else url + "/v1/traces"', 'url = url + "/v1/traces"', (OTLP,)),
    Bug("only-500-marks-a-trace-failed", "tserve/service/tracing.py", "if status >= 500:", "if status == 500:",
        (FAILED_SPANS,)),
    Bug("spans-without-the-request-id", "tserve/service/tracing.py",
        'return scope.get("state", {}).get("request_id", "")', 'return ""', (FAILED_SPANS,)),
    Bug("drain-waits-past-its-timeout", "tserve/service/shutdown.py",
        "while not self.registry.idle() and time.monotonic() < deadline:", "while not self.registry.idle():", (DRAIN,)),
    Bug("second-signal-drains-again", "tserve/service/shutdown.py",
        "if self._drain is not None or self.should_exit:", "if self.should_exit:", (DRAIN,)),
    Bug("log-level-flag-ignored", "tserve/service/cli.py", "root.setLevel(level.upper())",
        "root.setLevel(logging.INFO)", (f"{OBS}test_log_level_decides_whether_access_lines_are_written",)),
    Bug("inputs-logged-under-the-clients-header", "tserve/service/routes/deps.py",
        '"request_id": getattr(request.state, "request_id", None), "inputs"',
        '"request_id": request.headers.get("x-request-id"), "inputs"',
        (f"{OBS}test_the_inputs_log_line_carries_the_request_id_the_server_generated",)),
    Bug("tempering-after-the-nucleus", LOGITS, "self.shaping = [self.temperature, self.top_k_top_p]",
        "self.shaping = [self.top_k_top_p, self.temperature]", (MIXED_BATCH,)),
    Bug("filtered-rows-share-the-first-rows-top-k", LOGITS,
        "top_k = to_device([max(rows[i].params.top_k, 0) for i in idx], dev)",
        "top_k = to_device([max(rows[idx[0]].params.top_k, 0) for i in idx], dev)", (MIXED_BATCH,)),
    Bug("top-p-measured-over-the-whole-distribution", LOGITS,
        'probs = torch.softmax(sorted_logits.float().masked_fill(remove, float("-inf")), dim=-1)',
        "probs = torch.softmax(sorted_logits.float(), dim=-1)",
        (f"{SAMPLING}test_top_p_measures_the_mass_of_what_top_k_kept",)),
    Bug("logprobs-read-before-the-bias", "tserve/model/decoding/lm_runner.py",
        "logprobs = token_logprobs(constrained, tokens, max(p.logprobs or 0 for p in params))",
        "logprobs = token_logprobs(logits, tokens, max(p.logprobs or 0 for p in params))", (CONSTRAINED_LOGPROBS,)),
    Bug("eos-ban-of-some-rows-bans-the-first-eos-only", LOGITS,
        "rows_, ids = zip(*((i, e) for i in idx for e in self.eos_ids), strict=True)",
        "rows_, ids = zip(*((i, e) for i in idx for e in self.eos_ids[:1]), strict=True)", (EOS_IDS,)),
    Bug("every-row-eos-ban-bans-the-first-eos-only", LOGITS,
        "self._eos_tensors[device] = to_device(list(self.eos_ids), device)",
        "self._eos_tensors[device] = to_device(self.eos_ids[:1], device)", (EOS_IDS,)),
    Bug("greedy-exclusions-ban-the-first-eos-only", LOGITS,
        "return [self.banned + self.eos_ids if self._eos_banned(r) else self.banned for r in rows]",
        "return [self.banned + self.eos_ids[:1] if self._eos_banned(r) else self.banned for r in rows]", (EOS_IDS,)),
    Bug("grammar-rescue-undone-by-the-eos-ban", LOGITS,
        "self.constraints = [self.penalties, self.logit_bias, self.ban_eos, self.ban_ids, self.force_eos,\n"
        "                            self.force_first, self.grammar]",
        "self.constraints = [self.penalties, self.logit_bias, self.grammar, self.ban_eos, self.ban_ids, "
        "self.force_eos,\n                            self.force_first]",
        (f"{SAMPLING}test_a_grammar_that_allows_only_eos_wins_over_min_tokens",)),
    Bug("never-early-stopping-at-any-length-penalty", "tserve/model/decoding/beam_search.py",
        'if s.early_stopping == "never" and s.length_penalty > 0.0:', 'if s.early_stopping == "never":',
        (f"{SAMPLING}test_never_stopping_early_with_a_negative_length_penalty_judges_running_beams_at_their_length",)),
    Bug("q8_0-figures-stored-under-int8", EVALUATE,
        'scheme = quantize if quantize in ("int4", "q8_0", "q4_0") else resolve_activations(int8_activations)',
        'scheme = quantize if quantize in ("int4", "q4_0") else resolve_activations(int8_activations)',
        (QUANTIZED_FIGURES,)),
    Bug("q8_0-figures-report-activations", EVALUATE, 'detail = {"group_size": 32} if quantize in ("int4", "q8_0", "q4_0")',
        'detail = {"group_size": 32} if quantize in ("int4", "q4_0")', (QUANTIZED_FIGURES,)),
    Bug("float32-eval-drops-block-format-figures", EVALUATE, "if k in QUANTIZED_FIGURES.values()}",
        'if k.startswith("int")}', (QUANTIZED_FIGURES,)),
    Bug("quantized-eval-card-rendered-before-metrics", EVALUATE,
        "            write_json(path / METRICS_FILE, stored | {QUANTIZED_FIGURES[scheme]: figures})\n"
        "            write_card(path)",
        "            write_card(path)\n"
        "            write_json(path / METRICS_FILE, stored | {QUANTIZED_FIGURES[scheme]: figures})", (QUANTIZED_FIGURES,)),
    Bug("lm-agreement-ignores-limit", EVALUATE,
        "stream = token_stream(quantized.tokenizer, list(test[:limit] if limit else test))",
        "stream = token_stream(quantized.tokenizer, list(test))", (LIMITED,)),
    Bug("lm-agreement-against-the-quantized-model", EVALUATE,
        'reference = load(path, device=quantized.device, dtype="float32")',
        'reference = load(path, device=quantized.device, dtype="float32", quantize=quantized.quantization)', (LIMITED,)),
    Bug("translation-validation-reads-en-de", "tserve/training/translation.py",
        '    val_examples = encode_pairs(tokenizer, (splits.get("valid") or train_pairs)[: p.val_pairs], p.max_len,\n'
        "                                languages)",
        '    val_examples = encode_pairs(tokenizer, (splits.get("valid") or train_pairs)[: p.val_pairs], p.max_len)',
        (DE_EN,)),
    Bug("continued-translator-forgets-its-direction", "tserve/training/translation.py",
        'direction = opts.direction or inherited or "en-de"', 'direction = opts.direction or "en-de"', (DE_EN,)),
    Bug("translation-continued-run-does-not-keep-start-weights", "tserve/training/translation.py",
        "start_checkpoint=init is not None)", "start_checkpoint=False)", (f"{CONTINUED}[translation]",)),
    Bug("vit-dropout-flag-ignored", "tserve/training/vit.py", "    set_dropout(model, opts.dropout)\n", "",
        (f"{CONTINUED}[vit]",)),
    Bug("vit-continued-run-not-recorded", "tserve/training/vit.py", "    record_init(info, opts)\n", "",
        (f"{CONTINUED}[vit]",)),
    Bug("autocast-ignores-amp-off", "tserve/training/loop.py", 'if device.type != "cuda" or not enabled:',
        'if device.type != "cuda":', (f"{TRAINING}test_autocast_is_off_when_the_loop_turns_it_off_even_on_cuda",)),
    Bug("half-leaves-the-card-stale", "tserve/training/cli.py",
        "    save_file(halved, str(path), metadata=metadata)\n    write_card(args.checkpoint)\n",
        "    save_file(halved, str(path), metadata=metadata)\n",
        (f"{TRAINING}test_half_stores_float16_keeps_the_metadata_and_rerenders_the_card",)),
    Bug("retrained-weights-keep-the-old-test-figures", "tserve/training/card.py",
        "    (directory / METRICS_FILE).unlink(missing_ok=True)\n", "",
        (f"{TRAINING}test_weights_trained_into_a_directory_with_test_figures_leave_them_behind[vit]",)),
]
