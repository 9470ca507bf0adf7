"""Planted bugs of the fifth survey (docs/testing/request-layer.md): the code between a client and the engine (the
routes, the served models, the request schemas, the registry and settings, image preprocessing, file jobs), where a
field is read on one route or protocol and not another, a default or a limit drifts, or a batch's results are matched
to the wrong inputs. Their tests are the modules tests/*/test_request_layer_*.py and those named. Part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

COMPLETIONS = "tserve/service/routes/completions.py"
LM_SERVED = "tserve/service/generation/served.py"
LAYER_LM = "tests/http/test_request_layer_completions.py::"
INPUTS = "tserve/service/translation/inputs.py"
LIBRETRANSLATE = "tserve/service/routes/libretranslate.py"
TRANSLATIONS = "tserve/service/routes/translations.py"
LANGUAGES = "tserve/service/translation/languages.py"
LAYER_MT = "tests/http/test_request_layer_translation.py::"
STREAM_COMBINATIONS = ("tests/engine/test_option_combinations_streaming.py::"
                       "test_a_streamed_completion_is_the_unstreamed_one_under_every_combination")

ROUTE_BUGS = [
    # /v1/completions and /v1/chat/completions
    Bug("best-of-below-n-accepted", COMPLETIONS,
        "if body.best_of is not None and body.best_of != body.n:", "if body.best_of is not None and body.best_of > body.n:",
        (f"{LAYER_LM}test_a_best_of_other_than_n_is_refused_whether_below_or_beyond",)),
    Bug("chat-stream-usage-chunk-whenever-stream-options", COMPLETIONS,
        "        include_usage = bool(body.stream_options and body.stream_options.include_usage)\n\n"
        "        async def chunks() -> AsyncIterator[str]:\n"
        '            base = {"id": completion_id, "object": "chat.completion.chunk"',
        "        include_usage = body.stream_options is not None\n\n"
        "        async def chunks() -> AsyncIterator[str]:\n"
        '            base = {"id": completion_id, "object": "chat.completion.chunk"',
        (f"{LAYER_LM}test_stream_options_without_include_usage_send_no_usage_on_either_route",)),
    Bug("chat-default-max-tokens-past-the-server-limit", COMPLETIONS,
        "max(1, min(cfg.max_tokens_limit, served.max_len - len(ids)))", "max(1, served.max_len - len(ids))",
        (f"{LAYER_LM}test_a_chat_without_max_tokens_stops_at_the_servers_max_tokens_limit",)),
    Bug("penalties-swapped", COMPLETIONS,
        "presence_penalty=body.presence_penalty,\n        frequency_penalty=body.frequency_penalty,",
        "presence_penalty=body.frequency_penalty,\n        frequency_penalty=body.presence_penalty,",
        ("tests/http/test_http_contract.py::test_presence_and_frequency_penalties",)),
    Bug("streamed-completion-logprobs-0-dropped", COMPLETIONS,
        "                lp = None\n                if body.logprobs is not None:",
        "                lp = None\n                if body.logprobs:", (STREAM_COMBINATIONS,)),
    Bug("unstreamed-completion-logprobs-0-dropped", COMPLETIONS,
        "        lp = c.logprobs_dict(served.tokenizer) if body.logprobs is not None else None\n        out.append",
        "        lp = c.logprobs_dict(served.tokenizer) if body.logprobs else None\n        out.append",
        (STREAM_COMBINATIONS,)),
    Bug("echo-chunk-without-continuous-usage", COMPLETIONS,
        '"finish_reason": None}, _continuous_usage(body))\n\n'
        "            def render(c: Choice, event: Event, offsets: list[int]) -> dict[str, Any]:",
        '"finish_reason": None}, False)\n\n'
        "            def render(c: Choice, event: Event, offsets: list[int]) -> dict[str, Any]:",
        (f"{LAYER_LM}test_continuous_usage_is_in_the_echoed_prompts_chunk_too",)),
    Bug("structured-outputs-json-object-false-read-as-given", COMPLETIONS,
        "        if wanted.json_object:\n", "        if wanted.json_object is not None:\n",
        (f"{LAYER_LM}test_structured_outputs_json_object_false_beside_a_regex_leaves_the_regex",)),
    Bug("oip-lm-takes-a-bool-for-a-number", LM_SERVED,
        "isinstance(value, int | float if kind is float else int) and not isinstance(value, bool)",
        "isinstance(value, int | float if kind is float else int)",
        (f"{LAYER_LM}test_a_v2_number_parameter_sent_as_a_boolean_is_refused",)),
    Bug("chat-id-with-the-completions-prefix", COMPLETIONS, 'new_id("chatcmpl")', 'new_id("cmpl")',
        (f"{LAYER_LM}test_each_route_names_its_answers_with_its_own_id_prefix_and_object",)),
    Bug("id-prompt-echo-offsets-skip-its-specials", COMPLETIONS,
        "skip_special_tokens=skip))", "skip_special_tokens=True))",
        (f"{LAYER_LM}test_echoed_prompt_offsets_point_into_the_echoed_text_for_text_and_id_prompts",)),
    # /v1/translations and LibreTranslate's routes
    Bug("glossary-of-exactly-the-entry-limit-refused", INPUTS,
        "    if len(glossary) > max_entries:", "    if len(glossary) >= max_entries:",
        (f"{LAYER_MT}test_a_glossary_of_exactly_the_entry_limit_with_terms_of_100_characters_is_taken",)),
    Bug("glossary-term-of-100-characters-refused", INPUTS,
        "len(term) > MAX_GLOSSARY_TERM_CHARS:", "len(term) >= MAX_GLOSSARY_TERM_CHARS:",
        (f"{LAYER_MT}test_a_glossary_of_exactly_the_entry_limit_with_terms_of_100_characters_is_taken",)),
    Bug("only-the-last-inputs-characters-checked", INPUTS,
        '            raise InvalidInput(f"input {i} is empty", "empty_input")\n'
        '        check_input_chars(text, settings.max_input_chars, f"input {i}")',
        '            raise InvalidInput(f"input {i} is empty", "empty_input")\n'
        '    check_input_chars(text, settings.max_input_chars, f"input {i}")',
        (f"{LAYER_MT}test_every_text_of_a_batch_is_held_to_max_input_chars_not_only_the_last",)),
    Bug("sixteen-beams-and-alternatives-refused", INPUTS,
        "(high is not None and value > high)", "(high is not None and value >= high)",
        (f"{LAYER_MT}test_sixteen_beams_and_sixteen_alternatives_are_the_largest_taken",
         f"{LAYER_MT}test_libretranslate_takes_fifteen_alternatives_and_refuses_sixteen")),
    Bug("libretranslate-fifteen-alternatives-refused", LIBRETRANSLATE,
        "not 0 <= value <= MAX_ALTERNATIVES:", "not 0 <= value < MAX_ALTERNATIVES:",
        (f"{LAYER_MT}test_libretranslate_takes_fifteen_alternatives_and_refuses_sixteen",)),
    Bug("libretranslate-json-with-a-charset-read-as-a-form", LIBRETRANSLATE,
        'if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":',
        'if request.headers.get("content-type", "") == "application/json":',
        (f"{LAYER_MT}test_a_json_body_with_a_charset_is_read_as_json",)),
    Bug("libretranslate-query-string-fields-ignored", LIBRETRANSLATE,
        "fields: dict[str, Any] = dict(request.query_params)", "fields: dict[str, Any] = {}",
        (f"{LAYER_MT}test_fields_in_the_query_string_count_as_the_bodys",)),
    Bug("libretranslate-empty-format-refused", LIBRETRANSLATE,
        '        fmt = fields.get("format") or "text"', '        fmt = fields.get("format", "text")',
        (f"{LAYER_MT}test_an_empty_or_null_format_is_text",)),
    Bug("libretranslate-non-text-in-q-list-is-a-500", LIBRETRANSLATE,
        "    if isinstance(q, list) and q and all(isinstance(t, str) for t in q):", "    if isinstance(q, list) and q:",
        (f"{LAYER_MT}test_a_q_list_holding_a_non_text_is_a_400_in_libretranslates_shape",)),
    Bug("pivot-drops-return-alignment-silently", TRANSLATIONS,
        "    if body.stream or body.return_attention is not None or body.return_alignment:",
        "    if body.stream or body.return_attention is not None:",
        (f"{LAYER_MT}test_a_pivoted_pair_refuses_return_alignment_rather_than_answer_without_it",)),
    Bug("html-page-with-return-attention-not-refused", TRANSLATIONS,
        '    if body.format == "html" and (body.stream or body.return_attention is not None):',
        '    if body.format == "html" and body.stream:',
        (f"{LAYER_MT}test_an_html_page_refuses_return_attention",)),
    Bug("language-name-drops-the-region", LANGUAGES,
        '    return name if base == code.lower() else f"{name} ({code})"', "    return name",
        (f"{LAYER_MT}test_a_regional_language_is_named_with_its_region",)),
    Bug("traditional-chinese-named-by-its-code", LANGUAGES,
        '    "zt": "Chinese (traditional)",', '    "zt-unnamed": "Chinese (traditional)",',
        (f"{LAYER_MT}test_every_short_code_a_models_language_can_take_has_a_name",)),
]
