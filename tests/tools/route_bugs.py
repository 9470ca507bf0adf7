"""Planted bugs of the fifth survey (docs/testing/request-layer.md), its first half: the code between a client and
the engine (the routes, the served models, the request schemas, the registry and settings, image preprocessing, file
jobs, documents as translation input, the middlewares and the error map), where a field is read on one route or
protocol and not another, a default or a limit drifts, or a batch's results are matched to the wrong inputs. Their
tests are the modules tests/*/test_request_layer_*.py and those named. With `serving_bugs.SERVING_BUGS`, part of
`tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

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
REGISTRY = "tserve/service/registry.py"
REPOSITORY = "tserve/service/routes/repository.py"
SERVED = "tserve/service/served.py"
LAYER_OPS = "tests/deploy/test_request_layer_operations.py::"
DOTTED = f"{LAYER_OPS}test_a_dotted_name_loads_serves_and_unloads_and_a_second_unload_is_a_404"
SCHEMAS = "tserve/service/schemas.py"
EMBEDDINGS = "tserve/service/routes/embeddings.py"
DEPS = "tserve/service/routes/deps.py"
LAYER_SCHEMAS = "tests/http/test_request_layer_schemas.py::"
MULTIPART_FIELDS = f"{LAYER_SCHEMAS}test_a_multipart_images_form_fields_are_read_as_a_json_bodys"
CLASSIFICATIONS = "tserve/service/routes/classifications.py"
FILES = "tserve/service/routes/files.py"
FILE_JOBS = "tserve/service/translation/file_jobs.py"
PREPROCESSING = "tserve/model/preprocessing.py"
LAYER_FILES = "tests/http/test_request_layer_images_files.py::"
IMAGE_AND_IMAGES = f"{LAYER_FILES}test_an_image_beside_a_list_of_images_is_answered_first_and_each_result_is_its_own_pictures"
IMAGE_CONFIGS = "tests/model/test_option_combinations_images.py::"
APP = "tserve/service/app.py"
ERRORS = "tserve/service/errors.py"
LAYER_APP = "tests/http/test_request_layer_app.py::"
CORS = f"{LAYER_APP}test_cors_preflights_allow_get_and_the_request_id_header_but_not_other_methods"
BODY_LIMIT = f"{LAYER_APP}test_a_body_of_exactly_the_limit_passes_by_length_and_chunked_and_one_byte_more_is_413"
INTERNAL = f"{LAYER_APP}test_an_internal_error_is_counted_and_logged_as_a_500_under_the_id_its_body_names"
CLOSED = f"{LAYER_APP}test_a_client_that_leaves_while_its_body_is_read_is_counted_as_499"
TRANSLATION_INPUT = "tserve/service/engine/translation_input.py"
LAYER_DOCS = "tests/http/test_request_layer_documents.py::"
DRAINING = f"{LAYER_OPS}test_while_draining_the_repository_api_is_503_and_every_worker_refuses_new_work"
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
    # operations: the registry, the repository API, settings, task modules
    Bug("unload-of-an-unloaded-name-500", REGISTRY,
        '            if state == "UNLOADING" and served is None:', '            if state == "UNLOADING" and name not in self.states:',
        (DOTTED,)),
    Bug("dotted-model-names-refused", REPOSITORY,
        'if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():',
        'if not name.replace("-", "").replace("_", "").isalnum():', (DOTTED,)),
    Bug("model-name-never-checked", REPOSITORY,
        '    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():\n'
        '        raise OIPError(400, "a model name is letters, digits, \'-\', \'_\' and \'.\'")\n', "",
        (f"{LAYER_OPS}test_an_invalid_model_name_is_refused_before_it_is_claimed",)),
    Bug("readyz-lists-models-in-load-order", "tserve/service/routes/health.py",
        'return JSONResponse({"status": "ready", "models": sorted(reg.models)})',
        'return JSONResponse({"status": "ready", "models": list(reg.models)})', (DOTTED,)),
    Bug("drain-refuses-only-the-main-worker", REGISTRY,
        "        for served in self.models.values():\n            for worker in served.workers:\n"
        "                worker.refuse_new()",
        "        for served in self.models.values():\n            served.worker.refuse_new()", (DRAINING,)),
    Bug("text-input-at-the-exact-length-refused", SERVED,
        '        if len(ids) > limit:\n            raise ValueError(f"the input has',
        '        if len(ids) >= limit:\n            raise ValueError(f"the input has',
        (f"{LAYER_OPS}test_embeddings_take_a_text_of_exactly_the_models_length_and_refuse_one_token_more",)),
    Bug("lens-layer-past-the-last-accepted", "tserve/model/attention_maps.py",
        "bad = [i for i in asked if not 0 <= i < count]", "bad = [i for i in asked if not 0 <= i <= count]",
        (f"{LAYER_OPS}test_the_logit_lens_takes_its_last_layer_and_refuses_the_one_past_it",)),
    Bug("source-lang-ignored-by-a-language-model", SERVED,
        '        if source_lang is not None:\n            raise InvalidInput(f"model {self.name!r} takes no source_lang")\n',
        "", (f"{LAYER_OPS}test_source_lang_is_refused_by_a_language_models_embeddings",)),
    Bug("no-model-of-a-task-is-a-400", REGISTRY,
        '                raise not_found(f"no {task} model is served")',
        '                raise bad_request(f"no {task} model is served", "model_required")',
        (f"{LAYER_OPS}test_a_request_without_a_model_for_a_task_no_model_serves_is_a_404",)),
    Bug("repository-api-open-while-draining", REPOSITORY,
        "    return ready_registry(request)", "    return request.app.state.registry", (DRAINING,)),
    Bug("task-module-cannot-replace-a-built-in-task", "tserve/service/tasks.py",
        "    SERVED[cls.task] = cls", "    SERVED.setdefault(cls.task, cls)",
        (f"{LAYER_OPS}test_a_task_module_that_registers_a_built_in_task_serves_it",)),
    Bug("model-entry-without-a-name-accepted", "tserve/service/settings.py",
        "            if not sep or not name or not path:", "            if not sep:",
        (f"{LAYER_OPS}test_a_model_entry_without_a_name_or_a_path_is_refused_from_flags_and_from_the_environment",)),
    Bug("a-loading-model-answers-429", REGISTRY,
        'raise overloaded(f"model {name!r} is {self.states[name].state.lower()}", status=503)',
        'raise overloaded(f"model {name!r} is {self.states[name].state.lower()}")',
        ("tests/http/test_repository.py::test_unloading_drains_refuses_and_gives_the_memory_back",)),
    Bug("repository-lists-directories-without-a-config", "tserve/service/settings.py",
        'return files | {d.name: d for d in sorted(root.iterdir()) if (d / "config.json").is_file()}',
        'return files | {d.name: d for d in sorted(root.iterdir()) if d.is_dir()}',
        ("tests/deploy/test_option_combinations_cli.py::"
         "test_a_checkpoint_directory_wins_over_a_gguf_file_of_its_name_in_the_models_directory",)),
    Bug("a-named-model-of-another-task-served", REGISTRY,
        "        if task is not None and served.task != task:\n            raise bad_request",
        "        if task is None and served.task != task:\n            raise bad_request",
        ("tests/http/test_tasks.py::test_a_fourth_task_module_is_served_with_no_edits_elsewhere",)),
    Bug("a-worker-refusing-new-work-answers-429", "tserve/service/errors.py",
        "        return overloaded(str(exc), status=503)\n    if isinstance(exc, QueueFull):",
        "        return overloaded(str(exc))\n    if isinstance(exc, QueueFull):",
        (f"{LAYER_OPS}test_a_request_that_meets_a_worker_already_refusing_is_a_503_not_a_429",)),
    # request schemas and the inspection routes
    Bug("top-logprobs-five-refused", SCHEMAS,
        "top_logprobs: int | None = Field(None, ge=0, le=5)", "top_logprobs: int | None = Field(None, ge=0, lt=5)",
        (f"{LAYER_SCHEMAS}test_chat_top_logprobs_of_five_list_five_alternatives_and_six_is_refused",)),
    Bug("temperature-two-refused", SCHEMAS,
        "temperature: float = Field(1.0, ge=0.0, le=2.0)", "temperature: float = Field(1.0, ge=0.0, lt=2.0)",
        (f"{LAYER_SCHEMAS}test_temperature_two_is_the_top_of_its_range_and_just_above_is_refused",)),
    Bug("four-stop-strings-refused", SCHEMAS, "if len(stops) > 4:", "if len(stops) >= 4:",
        (f"{LAYER_SCHEMAS}test_four_stop_strings_are_taken_and_a_fifth_is_refused",)),
    Bug("top-k-minus-one-refused", SCHEMAS,
        "top_k: int = Field(0, ge=-1, description=", "top_k: int = Field(0, ge=0, description=",
        (f"{LAYER_SCHEMAS}test_top_k_minus_one_samples_as_no_top_k_filter",)),
    Bug("lens-layers-answered-in-sorted-order", "tserve/model/logit_lens.py",
        "    for layer in layers:\n", "    for layer in sorted(layers):\n",
        (f"{LAYER_SCHEMAS}test_lens_layers_come_back_in_the_order_asked_each_the_layer_it_names",)),
    Bug("embeddings-text-beside-an-images-list-accepted", EMBEDDINGS,
        "if images and body.input is not None:", "if body.image is not None and body.input is not None:",
        (f"{LAYER_SCHEMAS}test_text_beside_images_is_refused_for_either_image_field",)),
    Bug("attention-json-lists-unset-fields", "tserve/service/routes/attention.py",
        "response_model=AttentionResponse | BertVizResponse, response_model_exclude_unset=True,",
        "response_model=AttentionResponse | BertVizResponse,",
        (f"{LAYER_SCHEMAS}test_a_language_models_attention_answers_carry_only_its_own_fields",)),
    Bug("return-attention-bound-reached-refused", DEPS, "    if floats > limit:\n", "    if floats >= limit:\n",
        (f"{LAYER_SCHEMAS}test_return_attention_of_exactly_the_weight_limit_is_served",)),
    Bug("lens-default-top-k-of-three", SCHEMAS,
        "top_k: int = Field(5, ge=1, le=20)", "top_k: int = Field(3, ge=1, le=20)",
        (f"{LAYER_SCHEMAS}test_lens_without_top_k_lists_five_tokens_per_position",)),
    Bug("json-object-beside-another-constraint-ignored", "tserve/service/request_schemas.py",
        '        given += ["json_object"] if self.json_object else []\n',
        '        given += ["json_object"] if self.json_object and not given else []\n',
        (f"{LAYER_SCHEMAS}test_json_object_beside_another_structured_output_is_refused",)),
    Bug("embeddings-source-lang-dropped", EMBEDDINGS,
        "served.embedding_ids(text, body.source_lang)", "served.embedding_ids(text)",
        ("tests/http/test_multilingual_http.py::test_embeddings_read_the_source_language",)),
    Bug("translation-return-attention-bound-counts-one-module", DEPS,
        "floats = outputs * served.generated_attention_modules * len(layers)", "floats = outputs * len(layers)",
        ("tests/http/test_option_combinations_inspection_pairs.py::"
         "test_the_translation_weight_bound_counts_the_longest_input",)),
    Bug("embeddings-dimensions-ignored", EMBEDDINGS,
        "    if body.dimensions is not None and body.dimensions != size:",
        "    if body.dimensions is not None and body.dimensions > size:",
        (f"{LAYER_SCHEMAS}test_embeddings_take_their_own_dimensions_and_refuse_another_length",)),
    Bug("classification-form-priority-dropped", "tserve/service/routes/classifications.py",
        '("model", "top_k", "priority")', '("model", "top_k")', (MULTIPART_FIELDS,)),
    Bug("embeddings-form-reads-only-model-and-format", EMBEDDINGS,
        '("model", "encoding_format", "dimensions", "priority")', '("model", "encoding_format")', (MULTIPART_FIELDS,)),
    # images and file jobs
    Bug("classifications-single-image-after-the-list", CLASSIFICATIONS,
        "images = ([body.image] if body.image is not None else []) + list(body.images or [])",
        "images = list(body.images or []) + ([body.image] if body.image is not None else [])", (IMAGE_AND_IMAGES,)),
    Bug("classification-index-counts-from-one", CLASSIFICATIONS,
        "for i, ranked in enumerate(results)]", "for i, ranked in enumerate(results, 1)]", (IMAGE_AND_IMAGES,)),
    Bug("oip-pixels-of-any-datatype", "tserve/service/vision/served.py",
        'if tensor.get("datatype") != "FP32" or len(tensor["shape"]) != 4', 'if len(tensor["shape"]) != 4',
        (f"{LAYER_FILES}test_oip_pixels_of_another_datatype_than_fp32_are_a_protocol_400",)),
    Bug("file-at-exactly-max-file-bytes-refused", FILES, "    if len(data) > limit:\n", "    if len(data) >= limit:\n",
        (f"{LAYER_FILES}test_a_file_of_exactly_max_file_bytes_is_taken_and_one_byte_more_is_413",)),
    Bug("windows-upload-path-kept-in-the-name", FILES,
        '(upload.filename or "").replace("\\\\", "/").rsplit("/", 1)[-1]', '(upload.filename or "").rsplit("/", 1)[-1]',
        (f"{LAYER_FILES}test_an_upload_named_by_a_path_keeps_only_its_base_name",)),
    Bug("deleting-a-finished-job-keeps-it", FILE_JOBS, "        else:\n            self._delete(job)\n", "",
        (f"{LAYER_FILES}test_deleting_a_finished_job_deletes_it_and_its_file",)),
    Bug("a-failed-jobs-error-loses-its-code", FILE_JOBS,
        'return {"message": exc.message, "type": exc.type, "code": exc.code}',
        'return {"message": exc.message, "type": "server_error", "code": None}',
        (f"{LAYER_FILES}test_a_job_the_engine_refused_fails_with_the_errors_type_and_code",)),
    Bug("sweep-counts-from-creation", FILE_JOBS,
        "and now - j.finished > self.retention_s]", "and now - j.created > self.retention_s]",
        (f"{LAYER_FILES}test_the_retention_counts_from_a_jobs_end_not_its_start",)),
    Bug("file-cache-opt-out-only-as-false", FILES, '.lower() not in ("false", "0", "no"))', '.lower() != "false")',
        (f"{LAYER_FILES}test_each_way_of_saying_no_to_the_cache_translates_a_file_again",)),
    Bug("a-job-in-progress-still-reads-queued", FILE_JOBS,
        '        self.done_segments += 1\n        self.status = "running"\n', "        self.done_segments += 1\n",
        (f"{LAYER_FILES}test_a_job_read_while_it_runs_says_running",)),
    Bug("pivoted-job-announced-with-one-hops-total", FILES, "len(doc.jobs) * len(hops), work)", "len(doc.jobs), work)",
        (f"{LAYER_FILES}test_a_pivoted_job_announces_both_hops_sentences_from_its_start",)),
    Bug("multipart-classifications-ignore-the-model", CLASSIFICATIONS,
        '("model", "top_k", "priority"), max_images)', '("top_k", "priority"), max_images)',
        ("tests/engine/test_option_combinations_inspection.py::test_a_multipart_classification_reads_top_k",)),
    Bug("heatmap-grid-drops-the-last-partial-row", "tserve/service/vision/attention_png.py",
        "rows = (len(panels) + cols - 1) // cols", "rows = len(panels) // cols",
        (f"{LAYER_FILES}test_a_heatmap_grid_of_five_panels_draws_the_fifth_on_a_second_row",)),
    Bug("base64-lines-refused", "tserve/service/vision/served.py",
        'base64.b64decode("".join(value.split()), validate=True)', "base64.b64decode(value, validate=True)",
        (f"{LAYER_FILES}test_base64_wrapped_in_lines_is_read_as_the_same_image",)),
    Bug("preprocessor-default-resample-always-bilinear", PREPROCESSING,
        'resample = cfg.get("resample", _DEFAULT_RESAMPLE.get(processor, 2))', 'resample = cfg.get("resample", 2)',
        (f"{IMAGE_CONFIGS}test_each_preprocessor_config_is_read_as_transformers_reads_it",
         f"{IMAGE_CONFIGS}test_a_config_without_resample_takes_its_model_familys_processor_default")),
    Bug("deit-read-with-vits-processor", "tserve/model/importers/vit.py",
        'processor = "DeiTImageProcessor" if raw.get("model_type") == "deit" else "ViTImageProcessor"',
        'processor = "ViTImageProcessor"',
        (f"{IMAGE_CONFIGS}test_a_config_without_resample_takes_its_model_familys_processor_default",)),
    # the application around the routes: middlewares and the error map
    Bug("key-count-cleared-when-one-request-ends", "tserve/service/security.py", "            self.in_flight[key] -= 1",
        "            del self.in_flight[key]",
        (f"{LAYER_APP}test_a_key_under_a_limit_of_two_is_counted_down_by_one_when_one_of_its_requests_ends",)),
    Bug("cors-preflight-refuses-get", APP, 'allow_methods=["GET", "POST"]', 'allow_methods=["POST"]', (CORS,)),
    Bug("cors-preflight-refuses-the-request-id-header", APP,
        'allow_headers=["Authorization", "Content-Type", "X-Request-ID"]', 'allow_headers=["Authorization", "Content-Type"]',
        (CORS,)),
    Bug("chunked-body-of-exactly-the-limit-refused", APP, "if seen > limit:", "if seen >= limit:", (BODY_LIMIT,)),
    Bug("content-length-of-exactly-the-limit-refused", APP, "int(length) > limit)", "int(length) >= limit)",
        (BODY_LIMIT,)),
    Bug("file-routes-body-limit-without-room-for-form-fields", APP,
        "file_body = settings.max_file_bytes + 64 * 1024", "file_body = settings.max_file_bytes",
        (f"{LAYER_APP}test_a_file_of_exactly_max_file_bytes_with_its_form_fields_reaches_the_file_routes",)),
    Bug("request-id-not-truncated", APP, '.decode("latin-1")[:128] or', '.decode("latin-1") or',
        (f"{LAYER_APP}test_a_client_request_id_is_echoed_to_its_first_128_characters",)),
    Bug("internal-error-names-the-clients-header-not-the-request-id", ERRORS,
        '    request_id = getattr(request.state, "request_id", None)\n    log.exception',
        '    request_id = request.headers.get("x-request-id")\n    log.exception', (INTERNAL,)),
    Bug("client-closed-reported-as-408", ERRORS, '    return APIError(499, "client closed the request"',
        '    return APIError(408, "client closed the request"', (CLOSED,)),
    Bug("call-job-errors-lose-the-routes-code", "tserve/service/connection.py",
        "        raise engine_failure(exc, what, invalid_code) from exc", "        raise engine_failure(exc, what) from exc",
        (f"{LAYER_APP}test_an_input_past_the_context_is_a_400_coded_as_each_inspection_routes_error",)),
    Bug("engine-error-codes-replaced-by-the-routes-default", ERRORS, 'getattr(exc, "code", None) or invalid_code',
        "invalid_code", ("tests/http/test_http_limits.py::test_each_engine_failure_is_its_status_type_and_code",)),
    Bug("internal-error-answered-outside-the-middlewares", APP, "    app.add_middleware(InternalErrorMiddleware)\n", "",
        (f"{LAYER_APP}test_an_internal_errors_answer_carries_the_request_id_and_cors_headers",)),
    Bug("cut-json-body-read-as-a-parse-error", ERRORS,
        "        if isinstance(exc.__cause__, ClientDisconnect):", "        if False:", (CLOSED,)),
    # documents and pages as translation input
    Bug("glossary-term-matched-case-sensitively", TRANSLATION_INPUT, "text, flags=re.IGNORECASE)", "text)",
        ("tests/http/test_documents.py::test_glossary_terms_appear_verbatim_also_beside_ten_other_requests",)),
    Bug("glossary-term-matched-inside-a-longer-word", TRANSLATION_INPUT, 'rf"(?<!\\w){re.escape(term)}(?!\\w)"',
        'rf"{re.escape(term)}(?!\\w)"', (f"{LAYER_DOCS}test_a_glossary_term_inside_a_longer_word_is_not_placed",)),
    Bug("glossary-terms-looked-up-in-the-whole-document", TRANSLATION_INPUT, "if _occurs(source, seg)]",
        'if _occurs(source, " ".join(doc.segments))]',
        (f"{LAYER_DOCS}test_a_glossary_term_constrains_only_the_sentence_it_occurs_in",)),
    Bug("page-of-empty-tags-not-refused", TRANSLATION_INPUT, "        if not markup.blocks:\n",
        "        if not page.strip():\n", ("tests/http/test_html.py::test_bad_formats_are_400",
                                           f"{LAYER_DOCS}test_a_page_without_text_is_a_400_naming_the_empty_input")),
    Bug("empty-page-reported-as-input-too-long", TRANSLATION_INPUT,
        'raise InvalidInput("the page holds no text to translate", "empty_input")',
        'raise InvalidInput("the page holds no text to translate")',
        (f"{LAYER_DOCS}test_a_page_without_text_is_a_400_naming_the_empty_input",)),
    Bug("batch-results-misnumbered-after-a-multi-sentence-document", "tserve/service/translation/served.py",
        "            start += len(d.jobs)\n        return per_doc", "            start += 1\n        return per_doc",
        (f"{LAYER_DOCS}test_each_input_of_a_batch_gets_its_own_sentences_after_a_document_of_several",)),
    Bug("html-blocks-after-a-multi-sentence-block-take-its-sentences", "tserve/service/translation/served.py",
        "        i += m\n    return out", "        i += 1\n    return out",
        (f"{LAYER_DOCS}test_a_page_whose_first_block_has_two_sentences_keeps_every_later_block_on_its_own_text",)),
    Bug("document-usage-counts-only-the-first-sentence", "tserve/service/routes/translations.py",
        "    prompt = sum(len(j.source_ids) for d in docs for j in d.jobs)",
        "    prompt = sum(len(d.jobs[0].source_ids) for d in docs)",
        (f"{LAYER_DOCS}test_a_documents_usage_counts_the_source_tokens_of_every_sentence",)),
    Bug("a-request-whose-rows-cannot-be-claimed-is-lost", "tserve/service/engine/worker.py",
        "        except Exception as exc:  # noqa: BLE001 - the request's own failure, reported to it\n"
        "            self._fail(req, exc)\n            return None",
        "        except KeyboardInterrupt as exc:\n            self._fail(req, exc)\n            return None",
        ("tests/engine/test_option_combinations_after_failures.py::"
         "test_a_request_whose_rows_cannot_be_claimed_fails_alone_and_the_queue_goes_on",)),
]
