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
`auto` (`tests/files/test_option_combinations_files.py`), beside the module tests named. Part of
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
        '            check_chars(text, cfg.max_input_chars, f"input {i}")\n', "",
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
]
