"""Planted bugs of the fourth survey (docs/testing/configurations.md): a feature in a configuration other than its
tests' (dtype, weight format, attention backend, tokenizer, threads, model family, image configuration, setting
source, protocol, models served, an input exactly at a limit) or at another point of a lifecycle. Their tests are the
modules tests/*/test_option_combinations_{dtypes,formats,backends,tokenizer_families,after_failures,lifecycle,threads,
family_features,translator_families,image_configurations,setting_sources,protocols,many_models,edges}.py and those
named. Part of `tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

ATTENTION = "tserve/model/attention.py"
DECODER = "tserve/model/decoder.py"
QUANTIZE = "tserve/model/quantize.py"
TOKENIZER = "tserve/model/tokenizer.py"
GGUF_TOKENIZER = "tserve/model/gguf/tokenizer.py"
COMPLETIONS = "tserve/service/routes/completions.py"
REGISTRY = "tserve/service/registry.py"
REPOSITORY = "tserve/service/routes/repository.py"
DTYPES = "tests/engine/test_option_combinations_dtypes.py::"
HALF_CACHES = f"{DTYPES}test_a_half_precision_server_holds_its_caches_in_that_dtype_and_fits_twice_the_blocks"
FORMATS = "tests/model/test_option_combinations_formats.py::"
NARROW = f"{FORMATS}test_a_block_layer_narrower_than_whole_blocks_pads_its_inputs_after_them"
FUSED_NARROW = f"{FORMATS}test_fused_steps_of_several_rows_on_widths_off_the_blocks_equal_the_layers_steps"
LENS_TIED = f"{FORMATS}test_the_last_lens_layer_of_a_quantized_tied_model_is_its_own_prediction"
BACKENDS = "tests/model/test_option_combinations_backends.py::"
TOKENIZERS = "tests/model/test_option_combinations_tokenizer_families.py::"
LIFECYCLE = "tests/http/test_option_combinations_lifecycle.py::"
AFTER = "tests/engine/test_option_combinations_after_failures.py::"
PREFILL_FAILED = f"{AFTER}test_a_prompt_whose_prefill_failed_runs_again_as_on_a_fresh_engine"
FAMILIES = "tests/model/test_option_combinations_family_features.py::"
SPEC_STEP = f"{FAMILIES}test_a_speculative_steps_scores_equal_the_whole_forward_on_every_family"
IMAGES = "tests/engine/test_option_combinations_image_configurations.py::"
PREPROCESSOR = f"{IMAGES}test_a_preprocessor_config_is_read_for_the_models_channel_count_as_transformers_reads_it"
GREY_SERVED = f"{IMAGES}test_a_greyscale_transformers_vit_classifies_and_embeds_as_transformers_does"
GREY_BARE = f"{IMAGES}test_a_greyscale_checkpoint_without_a_preprocessor_config_loads_with_one_mean_and_std"
IMAGE_FAMILIES = "tests/http/test_image_families_http.py::"
TRANSLATORS = "tests/engine/test_option_combinations_translator_families.py::"
TRANSLATION_INPUT = "tserve/service/engine/translation_input.py"
SOURCES = "tests/deploy/test_option_combinations_setting_sources.py::"
EVERY_SETTING = (f"{SOURCES}test_every_setting_reads_the_same_from_its_flag_from_its_variable_and_from_the_variable_"
                 "through_the_cli")
INVALID_SIZE = f"{SOURCES}test_an_invalid_size_is_refused_when_the_settings_are_read"
SETTINGS = "tserve/service/settings.py"
PROTOCOLS = "tests/http/test_option_combinations_protocols.py::"
IMAGES_BOUNDED = f"{PROTOCOLS}test_max_prompts_bounds_images_on_v1_classifications_embeddings_and_v2"
LM_OIP = "tserve/service/generation/served.py"
MANY = "tests/http/test_option_combinations_many_models.py::"
EDGES = "tests/engine/test_option_combinations_edges.py::"
WINDOW_EXACT = f"{EDGES}test_a_window_pool_exactly_full_takes_the_prompt_and_one_block_short_is_refused"
PAGED = "tests/model/test_paged_kv.py::"
THREADS = "tests/model/test_option_combinations_threads.py::"
RELEASE_FAILS = f"{AFTER}test_a_queued_request_whose_release_fails_loses_no_other_request"
CHOICE_FAILED = f"{AFTER}test_a_choice_that_fails_for_one_row_of_a_batch_leaves_the_others_as_alone"
ROUTE_REPLACED = f"{LIFECYCLE}test_a_translator_replaced_by_the_route_takes_its_pairs_routes_as_a_fresh_server_would"
FROZEN = f"{LIFECYCLE}test_with_gc_freeze_a_replaced_model_and_a_failed_load_leave_the_heap_frozen"
PAIRS = "tests/http/test_option_combinations_completions_pairs.py::"
GGUF = "tests/model/test_gguf.py::"

CONFIG_BUGS = [
    # A model served in half precision.
    Bug("constraints-in-the-models-dtype", "tserve/model/decoding/logits.py",
        "scores = scores.float()  # a no-op", "scores = scores  # a no-op",
        (f"{DTYPES}test_bfloat16_logprobs_with_a_bias_and_penalties_are_float32_over_the_models_logits",)),
    Bug("argmax-bans-lose-the-scores-dtype", "tserve/model/kernels/cpu.py",
        'to_device(float("-inf"), dev, scores.dtype))', 'to_device(float("-inf"), dev))',
        ("tests/model/test_argmax_rows.py::test_excluded_ids_are_written_minus_inf_and_never_chosen[float64]",)),
    Bug("lm-kv-cache-in-float32", DECODER,
        "static_rows=static, dtype=dtype or p.dtype,", "static_rows=static, dtype=dtype or torch.float32,",
        (f"{HALF_CACHES}[bfloat16]", f"{HALF_CACHES}[float16]")),
    Bug("kv-block-bytes-at-float32s-size", "tserve/service/engine/kv_memory.py",
        "cfg.d_head * loaded.model.tok_emb.weight.element_size() * block_size", "cfg.d_head * 4 * block_size",
        (f"{HALF_CACHES}[bfloat16]", f"{HALF_CACHES}[float16]")),
    Bug("lens-softmax-in-the-models-dtype", "tserve/model/logit_lens.py",
        "probs = torch.softmax(head(states[layer][0]).float(), dim=-1)",
        "probs = torch.softmax(head(states[layer][0]), dim=-1).float()",
        (f"{DTYPES}test_the_logit_lens_of_a_bfloat16_model_reports_float32_probabilities_of_its_logits",)),
    Bug("embeddings-normalised-in-the-models-dtype", "tserve/model/embeddings.py",
        "return F.normalize(mean.float(), dim=-1)", "return F.normalize(mean, dim=-1).float()",
        (f"{DTYPES}test_bfloat16_text_embeddings_are_normalised_in_float32",)),
    Bug("float16-served-as-bfloat16", "tserve/model/checkpoint.py",
        '"bfloat16": torch.bfloat16, "float16": torch.float16}', '"bfloat16": torch.bfloat16, "float16": torch.bfloat16}',
        (f"{DTYPES}test_float16_loads_in_float16_and_bfloat16_in_bfloat16", f"{HALF_CACHES}[float16]")),
    Bug("translator-kv-cache-in-float32", "tserve/model/seq2seq.py",
        "kw = dict(dtype=dtype or p.dtype, device=p.device)", "kw = dict(dtype=dtype or torch.float32, device=p.device)",
        (f"{HALF_CACHES}[bfloat16]", f"{HALF_CACHES}[float16]")),
    Bug("bytes-per-token-at-float32s-size", "tserve/model/kv_cache.py",
        "return 2 * (layers + local) * heads * d_head * self.k.element_size()",
        "return 2 * (layers + local) * heads * d_head * 4",
        (f"{HALF_CACHES}[bfloat16]", f"{HALF_CACHES}[float16]")),
    # Weight formats beside the features whose tests run float32.
    Bug("fused-block-rows-padded-at-the-unpadded-stride", "tserve/model/kernels/decode_layers.cpp",
        "std::copy(x + m * K, x + (m + 1) * K, padded.data() + m * padded_K);",
        "std::copy(x + m * K, x + (m + 1) * K, padded.data() + m * K);",
        (f"{FUSED_NARROW}[q8_0]", f"{FUSED_NARROW}[q4_0]")),
    Bug("block-layer-inputs-padded-in-front", "tserve/model/block_quant.py",
        "            rows = F.pad(rows, (0, self._k_pad))", "            rows = F.pad(rows, (self._k_pad, 0))",
        (f"{NARROW}[40-q8_0-pytorch]", f"{NARROW}[80-q4_0-pytorch]", f"{FUSED_NARROW}[q8_0]")),
    Bug("lens-reads-the-float-embedding-of-a-tied-output-layer", "tserve/model/logit_lens.py",
        "head = lambda h: model.logits(model.norm_f(h))  # noqa: E731",
        "head = lambda h: model.scale_logits(torch.nn.functional.linear(model.norm_f(h), model.tok_emb.weight if "
        "model.cfg.tie_embeddings else model.lm_head.weight))  # noqa: E731",
        (f"{LENS_TIED}[int8]", f"{LENS_TIED}[int4]", f"{LENS_TIED}[q8_0]", f"{LENS_TIED}[q4_0]")),
    Bug("int4-packed-weights-not-a-buffer", QUANTIZE,
        'self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),\n'
        "                             persistent=False)",
        "self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)",
        (f"{FORMATS}test_a_quantized_model_holds_each_weight_once_in_its_formats_bytes[int4]",)),
    Bug("int8-exact-kernels-panels-counted-twice", QUANTIZE,
        "self.packed_bytes = 0 if self.exact else qweight.numel() * qweight.element_size()",
        "self.packed_bytes = qweight.numel() * qweight.element_size()",
        (f"{FORMATS}test_an_int8_layer_holds_its_weights_once_on_either_kernel[exact-kernel]",)),
    Bug("int8-7bit-weights-get-7bit-activations", QUANTIZE,
        'return self.activations in ("7bit", "split")', 'return self.activations != "full"',
        ("tests/model/test_quantize.py::test_an_int8_row_is_the_same_alone_and_beside_a_long_tailed_row[7bit-weights]",)),
    Bug("int8-row-sums-of-the-float-weight", QUANTIZE,
        'self.register_buffer("weight_row_sums", qweight.dequantize().sum(dim=1).unsqueeze(0), persistent=False)',
        'self.register_buffer("weight_row_sums", weight.sum(dim=1).unsqueeze(0), persistent=False)',
        ("tests/model/test_quantize.py::test_an_int8_row_is_the_same_alone_and_beside_a_long_tailed_row[split]",)),
    Bug("memory-key-without-the-quantizations-options", "tserve/service/translation/served.py",
        'self.weights_hash = f"{weights_hash(files)}/{self.loaded.quantization}/{self.loaded.dtype}{options}"',
        'self.weights_hash = f"{weights_hash(files)}/{self.loaded.quantization}/{self.loaded.dtype}"',
        ("tests/engine/test_option_combinations_memory_pairs.py::test_servers_of_one_format_computed_otherwise_keep_"
         "their_own_answers_in_a_shared_memory[int8-activations]",
         "tests/engine/test_option_combinations_memory_pairs.py::test_servers_of_one_format_computed_otherwise_keep_"
         "their_own_answers_in_a_shared_memory[int4-group-size]")),
    # Attention backends beside the model features their tests run on one backend.
    Bug("triton-decode-kernel-reads-sliding-layers", ATTENTION,
        '        elif self.window is not None and name != "cpu-decode":\n'
        "            self._cached_decode = None  # only the CPU kernel reads a window\n", "",
        (f"{BACKENDS}test_sliding_layers_decode_within_their_window_on_the_triton_backends[flash]",
         f"{BACKENDS}test_sliding_layers_decode_within_their_window_on_the_triton_backends[flash-decode]")),
    Bug("flash-takes-the-position-bias-as-a-boolean-mask", ATTENTION,
        '        if not need_weights and self.backend == "flash" and mask is not None and mask.is_floating_point():\n'
        "            attend = sdpa_attention  # a position bias: the Triton kernels take boolean masks only\n", "",
        (f"{BACKENDS}test_t5_position_bias_on_flash_equals_math_with_padded_sources",)),
    Bug("translator-step-mask-from-the-first-rows-position", "tserve/model/seq2seq.py",
        'mask = self._self_mask("dec", positions, kv_len, causal_mask(positions, kv_len), x.dtype)',
        'mask = self._self_mask("dec", positions, kv_len, causal_mask(positions[:1], kv_len), x.dtype)',
        (f"{BACKENDS}test_translator_rows_at_different_positions_in_one_step_each_attend_over_their_own[math]",
         f"{BACKENDS}test_translator_rows_at_different_positions_in_one_step_each_attend_over_their_own[sdpa]")),
    Bug("sliding-keys-counted-from-the-queries", DECODER,
        "keys = mask.size(-1) if mask is not None else kv_len or positions.size(1)",
        "keys = mask.size(-1) if mask is not None else positions.size(1)",
        ("tests/model/test_option_combinations_model_pairs.py::test_a_rows_prefix_read_back_is_the_same_whether_its_"
         "last_block_is_adjacent_or_not[gemma3-math]",)),
    Bug("shared-source-queries-see-the-padding", ATTENTION,
        "out, _ = self._attend(q.transpose(1, 2), k, v, mask, False, 0.0)",
        "out, _ = self._attend(q.transpose(1, 2), k, v, None, False, 0.0)",
        ("tests/model/test_models.py::test_rows_sharing_a_source_attend_to_it_as_one_query_block[sdpa]",)),
    Bug("one-query-grouped-attention-drops-the-mask", ATTENTION,
        "out, _ = attend(q.view(B, k.size(1), group, D), k, v, mask, False, dropout_p)",
        "out, _ = attend(q.view(B, k.size(1), group, D), k, v, None, False, dropout_p)",
        ("tests/model/test_option_combinations_cache.py::test_steps_over_a_shared_prefix_and_a_fresh_prompt_equal_the_"
         "whole_forward_for_each_backend_and_block_size[random-gqa-rope-sdpa-1]",)),
    Bug("cpu-decode-not-told-the-window", ATTENTION,
        "out = cache.decode(self._cached_decode, q, self.window)", "out = cache.decode(self._cached_decode, q)",
        ("tests/model/test_llama_family.py::test_sliding_window_decoding_in_the_paged_cache_equals_the_whole_forward"
         "[gemma3]",)),
    Bug("biased-decoder-steps-on-the-decode-kernel", ATTENTION,
        "cache.kv_len is not None and not biased", "cache.kv_len is not None",
        ("tests/model/test_t5.py::test_position_bias_on_every_cpu_backend[flash-decode]",)),
    Bug("window-mask-skipped-one-key-past-the-window", DECODER,
        "        if keys <= window:", "        if keys <= window + 1:",
        ("tests/model/test_llama_family.py::test_sliding_window_decoding_in_the_paged_cache_equals_the_whole_forward"
         "[gemma3]",)),
    # Tokenizer families beside the text features.
    Bug("echo-offsets-count-the-bos", COMPLETIONS,
        "skip_special_tokens=skip))", "skip_special_tokens=False))",
        (f"{PAIRS}test_echoed_prompt_logprobs_of_several_prompts_are_each_prompts_forward_pass",)),
    Bug("sentencepiece-added-tokens-read-as-pieces", TOKENIZER,
        "        if i in self._added:\n            return self._added[i]\n        piece = self._tok.id_to_token(i)\n"
        '        if piece is None:\n            return ""\n        if not self._byte_level:\n'
        '            return piece.replace(SPIECE_UNDERLINE, " ")\n',
        '        piece = self._tok.id_to_token(i)\n        if piece is None:\n            return ""\n'
        '        if not self._byte_level:\n            return piece.replace(SPIECE_UNDERLINE, " ")\n'
        "        if i in self._added:\n            return self._added[i]\n",
        (f"{TOKENIZERS}test_added_tokens_of_a_sentencepiece_vocabulary_keep_their_space_markers",)),
    Bug("library-stream-not-primed-with-the-prompt", TOKENIZER,
        "DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)",
        "DecodeStream(skip_special_tokens=skip_special_tokens)",
        ("tests/model/test_tokenizer.py::test_the_libraries_stream_sends_what_the_window_decodes_send[hf-mistral]",)),
    Bug("gguf-sentencepiece-without-byte-fallback", GGUF_TOKENIZER,
        "fuse_unk=True, byte_fallback=True))", "fuse_unk=True))",
        (f"{GGUF}test_tokenizer_is_the_original[mistral]",)),
    Bug("detokenizer-window-without-the-prompts-context", "tserve/model/detokenizer.py",
        "self._prefix = max(self._read - 5, 0)", "self._prefix = self._read",
        ("tests/model/test_tokenizer.py::test_incremental_with_prompt_keeps_leading_space",)),
    Bug("echo-of-an-id-prompt-drops-its-specials", COMPLETIONS,
        "served.tokenizer.decode(ids, skip_special_tokens=False)\n", "served.tokenizer.decode(ids)\n",
        (f"{PAIRS}test_prompts_given_as_token_ids_answer_as_the_same_prompts_given_as_text",)),
    Bug("served-stream-without-the-prompts-context", "tserve/service/engine/generation.py",
        "IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids), self.device)",
        "IncrementalDetokenizer(self.tokenizer), self.device)",
        ("tests/engine/test_option_combinations_streaming.py::test_a_streamed_completion_is_the_unstreamed_one_under_"
         "every_combination[mistral]",)),
    Bug("gguf-qwen2-not-nfc-normalised", GGUF_TOKENIZER,
        '"qwen2": lambda: (normalizers.NFC(), _split_then_bytes(_QWEN2_REGEX), False),',
        '"qwen2": lambda: (None, _split_then_bytes(_QWEN2_REGEX), False),',
        (f"{GGUF}test_named_pre_tokenizers_split_as_the_released_tokenizers[qwen2]",)),
    Bug("sentencepiece-token-shows-only-its-first-marker", TOKENIZER,
        'return piece.replace(SPIECE_UNDERLINE, " ")\n        table', 'return piece.replace(SPIECE_UNDERLINE, " ", 1)\n        table',
        (f"{TOKENIZERS}test_a_piece_for_a_run_of_spaces_shows_every_space_it_stands_for",)),
    Bug("gguf-sentencepiece-strips-a-space-it-never-added", GGUF_TOKENIZER,
        '*([decoders.Strip(" ", 1, 0)] if space_prefix else [])', 'decoders.Strip(" ", 1, 0)',
        (f"{GGUF}test_sentencepiece_without_a_space_prefix",)),
    # Models and the server across their lifecycle.
    Bug("replacement-keeps-the-derived-routes", REGISTRY,
        "                    worker.replaced()\n            self._changed()\n",
        "                    worker.replaced()\n            else:  # a new name: the set of served models changed\n"
        "                self._changed()\n",
        (ROUTE_REPLACED,)),
    Bug("route-replacement-never-retired", REPOSITORY,
        "        if reg.install(name, await _beside_serving(reg.prepare, name, source)):\n"
        "            await asyncio.to_thread(reg.retire)",
        "        reg.install(name, await _beside_serving(reg.prepare, name, source))",
        (ROUTE_REPLACED,)),
    Bug("route-replacement-retired-as-unloaded", REPOSITORY,
        "            await asyncio.to_thread(reg.retire)", "            await asyncio.to_thread(reg.retire, name)",
        (ROUTE_REPLACED,)),
    Bug("failed-load-leaves-the-heap-thawed", REGISTRY,
        "        _give_memory_back(self.settings.gc_freeze)\n        raise bad_request",
        "        _give_memory_back(False)\n        raise bad_request",
        (FROZEN,)),
    Bug("replacement-leaves-the-heap-thawed", REGISTRY,
        "        del mine  # the last reference: what is freed now is given back below\n"
        "        _give_memory_back(self.settings.gc_freeze)",
        "        del mine  # the last reference: what is freed now is given back below\n"
        "        _give_memory_back(self.settings.gc_freeze and unloaded is not None)",
        (FROZEN,)),
    Bug("replaced-model-moves-behind-the-others", REGISTRY,
        "            old = self.models.get(name)\n            self.models[name] = served",
        "            old = self.models.pop(name, None)\n            self.models[name] = served",
        (ROUTE_REPLACED,)),
    Bug("shutdown-keeps-finished-files", "tserve/service/translation/file_jobs.py",
        "        for job in list(self.jobs.values()):\n            await self.cancel(job)",
        "        for job in list(self.jobs.values()):\n            if job.status not in TERMINAL:\n"
        "                await self.cancel(job)",
        (f"{LIFECYCLE}test_a_stopped_server_leaves_no_finished_file_behind",)),
    Bug("memory-entries-gauge-unset-until-a-store", "tserve/service/translation/served.py",
        "            self.metrics.memory_entries.set(len(self.memory))  # what a file of an earlier run holds, from "
        "the start\n", "",
        ("tests/http/test_files.py::test_the_memory_survives_a_restart",)),
    # What a request that failed, timed out or was preempted leaves behind.
    Bug("release-keeps-the-pending-prompt-names", "tserve/model/decoding/lm_runner.py",
        "        self._computed_or_dropped(seq)\n        if self.drafter is not None:",
        "        if self.drafter is not None:", (PREFILL_FAILED,)),
    Bug("grammar-matcher-shared-between-requests", "tserve/model/decoding/structured.py",
        "GrammarState(self._template.deep_copy(), self.vocab_size)", "GrammarState(self._template, self.vocab_size)",
        ("tests/model/test_structured_output.py::test_every_sampled_answer_that_stops_validates[gpt2]",)),
    Bug("released-row-keeps-its-slot", "tserve/model/decoding/lm_runner.py",
        "            self.slots.free([seq.slot])\n            seq.slot = -1\n", "            self.slots.free([seq.slot])\n",
        (f"{AFTER}test_a_preempted_request_that_times_out_in_the_queue_gives_its_row_back_once",)),
    Bug("source-registered-before-its-encoding", "tserve/model/decoding/seq2seq_runner.py",
        "        dev = self.device\n        self.model.start(src.to(dev), torch.tensor(lengths, device=dev), self.cache,\n"
        "                         torch.tensor([s.cross_slot for s in seqs], device=dev))\n        for s in seqs:\n"
        "            s.encoded = True\n            source = source_key(s.job)\n"
        "            if self.reuse_sources and source not in self._slot_of_source:  # (two in one batch: the first)\n"
        "                self._slot_of_source[source], self._source_of_slot[s.cross_slot] = s.cross_slot, source\n",
        "        dev = self.device\n        for s in seqs:\n            s.encoded = True\n"
        "            source = source_key(s.job)\n"
        "            if self.reuse_sources and source not in self._slot_of_source:  # (two in one batch: the first)\n"
        "                self._slot_of_source[source], self._source_of_slot[s.cross_slot] = s.cross_slot, source\n"
        "        self.model.start(src.to(dev), torch.tensor(lengths, device=dev), self.cache,\n"
        "                         torch.tensor([s.cross_slot for s in seqs], device=dev))\n",
        (f"{AFTER}test_a_source_whose_encoding_failed_is_encoded_again_for_the_next_request[1]",
         f"{AFTER}test_a_source_whose_encoding_failed_is_encoded_again_for_the_next_request[3]")),
    Bug("draft-blocks-kept-before-the-first-judgement", "tserve/model/decoding/draft_model.py",
        "        if seq.draft_table is not None:\n            self.blocks.release(seq.draft_table)",
        "        if seq.draft_table is not None and seq.draft_computed:\n            self.blocks.release(seq.draft_table)",
        (f"{AFTER}test_a_request_failing_in_its_first_speculative_step_gives_its_draft_blocks_back",)),
    Bug("prompt-blocks-named-before-the-prefill-runs", "tserve/model/decoding/lm_runner.py",
        "        dev = self.device\n        logits = self.model.prefill(to_device(tokens, dev), to_device(lengths, dev), "
        "self.cache,\n                                    to_device([s.slot for s in seqs], dev),\n"
        "                                    to_device(start, dev) if any(start) else None,\n"
        "                                    kv_len=max(b + n for b, n in zip(start, lengths, strict=True)))\n"
        "        self._computed(seqs, [len(t) for t in ids])\n",
        "        dev = self.device\n        self._computed(seqs, [len(t) for t in ids])\n"
        "        logits = self.model.prefill(to_device(tokens, dev), to_device(lengths, dev), self.cache,\n"
        "                                    to_device([s.slot for s in seqs], dev),\n"
        "                                    to_device(start, dev) if any(start) else None,\n"
        "                                    kv_len=max(b + n for b, n in zip(start, lengths, strict=True)))\n",
        (PREFILL_FAILED,)),
    Bug("failed-beam-group-recorded-again", "tserve/service/engine/translation.py",
        "            failed.update(map(id, group))\n", "",
        (f"{AFTER}test_a_beam_group_whose_step_failed_counts_no_token_and_leaves_the_others_as_alone",)),
    Bug("a-fault-in-retiring-a-queued-request-drops-those-behind", "tserve/service/engine/worker.py",
        "                kept.extend(self.waiting)\n                self.waiting = kept\n",
        "                self.waiting = kept\n", (RELEASE_FAILS,)),
    Bug("a-fault-in-releasing-rows-loses-the-last-event", "tserve/service/engine/worker.py",
        "        finally:  # its client hears how it ended even where giving its rows back failed\n",
        "        except Exception:\n            raise\n        if True:\n", (RELEASE_FAILS,)),
    Bug("a-failed-choice-runs-the-batchs-forward-again", "tserve/service/engine/generation.py",
        "            if len(reqs) == 1:\n                raise  # (`_isolated` fails it)",
        "            if True:\n                raise  # (`_isolated` fails it)",
        (f"{CHOICE_FAILED}[prefill]", f"{CHOICE_FAILED}[decode]")),
    # The CPU kernels on another number of threads (the suite's workers run one).
    Bug("decode-head-span-not-a-divisor-of-the-heads", "tserve/model/kernels/paged_decode.cpp",
        "    while (H % smaller != 0) --smaller;\n", "",
        (f"{THREADS}test_decode_attention_gives_the_same_bits_on_one_two_and_three_threads",)),
    Bug("dense-rows-block-counted-from-the-threads-share", "tserve/model/kernels/dense_rows.cpp",
        "const int64_t n0 = block * kBlock;", "const int64_t n0 = (block - begin) * kBlock;",
        (f"{THREADS}test_dense_rows_give_the_same_bits_on_one_two_and_three_threads",
         f"{THREADS}test_a_fused_step_on_three_threads_equals_the_step_on_one[float32]")),
    Bug("block-linear-panel-counted-from-the-threads-share", "tserve/model/kernels/block_quant.cpp",
        "Pass p{view, 0, 0, 0, j * kCols,", "Pass p{view, 0, 0, 0, (j - begin) * kCols,",
        (f"{THREADS}test_block_layers_give_the_statements_bits_on_one_two_and_three_threads",
         f"{THREADS}test_a_fused_step_on_three_threads_equals_the_step_on_one[q8_0]")),
    Bug("int8-exact-gemm-panel-counted-from-the-threads-share", "tserve/model/kernels/int8_gemm.cpp",
        "const int64_t n0 = j * kCols, cols = std::min(kCols, N - n0);",
        "const int64_t n0 = (j - begin) * kCols, cols = std::min(kCols, N - n0);",
        (f"{THREADS}test_the_exact_int8_layer_gives_the_same_bits_on_one_two_and_three_threads",)),
    Bug("int8-rows-output-counted-from-the-threads-share", "tserve/model/kernels/int8_rows.cpp",
        "      float* orow = o + r * M;", "      float* orow = o + (r - begin) * M;",
        (f"{THREADS}test_int8_row_mappings_give_the_same_bits_on_one_two_and_three_threads",)),
    Bug("argmax-rows-input-counted-from-the-threads-share", "tserve/model/kernels/argmax_rows.cpp",
        "o[m] = argmax_row(data + m * n, n);", "o[m] = argmax_row(data + (m - begin) * n, n);",
        (f"{THREADS}test_argmax_rows_give_pytorchs_choice_on_one_two_and_three_threads",)),
    Bug("step-team-helpers-all-take-the-second-chunk", "tserve/model/kernels/step_team.h",
        "const auto [first, last] = chunk_of(posted_.n, posted_.grain, size_, thread);",
        "const auto [first, last] = chunk_of(posted_.n, posted_.grain, size_, 1);",
        (f"{THREADS}test_a_fused_step_on_three_threads_equals_the_step_on_one",)),
    Bug("portable-decode-heads-counted-from-the-threads-first", "tserve/model/kernels/paged_decode.cpp",
        "      for (int64_t j = h0; j < h1; ++j) {\n        head_attention(",
        "      for (int64_t j = 0; j < h1 - h0; ++j) {\n        head_attention(",
        (f"{THREADS}test_a_half_precision_cache_gives_the_same_bits_on_one_two_and_three_threads",)),
    # Language-model families beside the features their tests run on one family.
    Bug("speculative-verify-logits-unscaled", DECODER,
        "slots=slots, kv_len=kv_len)\n        return self.logits(hidden)",
        "slots=slots, kv_len=kv_len)\n        return self.lm_head(hidden)",
        (f"{SPEC_STEP}[granite-inside-the-window]", f"{SPEC_STEP}[gemma2-past-the-window]",
         f"{FAMILIES}test_sampled_rows_with_prompt_lookup_drafts_write_what_they_write_without[granite]")),
    Bug("prompt-scores-of-unscaled-logits", "tserve/service/engine/generation.py",
        "logits = self.model(tokens)[0, :-1].float()",
        "logits = self.model.lm_head(self.model.hidden_states(tokens)[:, :-1])[0].float()",
        (f"{FAMILIES}test_prompt_scoring_of_echo_equals_transformers_logprobs[granite]",
         f"{FAMILIES}test_prompt_scoring_of_echo_equals_transformers_logprobs[gemma2]")),
    Bug("sliding-mask-rebuilt-without-the-callers-mask", DECODER,
        "sliding = self._sliding(positions, mask, is_causal, kv_len) if",
        "sliding = self._sliding(positions, None, is_causal, kv_len) if",
        (f"{SPEC_STEP}[gemma3-inside-the-window]", f"{SPEC_STEP}[phi3-inside-the-window]")),
    Bug("window-prefix-hits-beyond-the-window-pool", "tserve/model/decoding/lm_runner.py",
        "            hits = self.windows.usable_prefix(names, ids, hits)", "            hits = hits",
        ("tests/model/test_window_blocks.py::test_a_cached_prefix_counts_as_far_as_its_last_window_is_held",)),
    Bug("draft-catch-up-starts-of-the-first-row", "tserve/model/decoding/draft_model.py",
        "torch.tensor(start, device=dev) if any(start) else None)",
        "torch.tensor(start, device=dev) if start[0] else None)",
        (f"{FAMILIES}test_a_draft_models_rows_caught_up_from_different_starts_read_their_whole_context[qwen3]",
         f"{FAMILIES}test_a_draft_models_rows_caught_up_from_different_starts_read_their_whole_context[gemma3]")),
    # Image classifiers in other configurations.
    Bug("grey-model-uploads-lose-their-transparency", "tserve/model/preprocessing.py",
        '        if image.mode in ("RGBA", "LA", "P"):',
        '        if image.mode in ("RGBA", "LA", "P") and self.n_channels == 3:',
        ("tests/engine/test_option_combinations_inspection.py::test_a_transparent_palette_image_is_seen_as_its_rgba_"
         "twin",)),
    Bug("greyscale-default-mean-of-three", "tserve/model/preprocessing.py",
        'mean = cfg.get("image_mean", [0.5] * n_channels) if normalize else [0.0] * n_channels',
        'mean = cfg.get("image_mean", [0.5, 0.5, 0.5]) if normalize else [0.0] * n_channels',
        (f"{PREPROCESSOR}[greyscale-none]", GREY_BARE)),
    Bug("unnormalised-greyscale-std-of-three", "tserve/model/preprocessing.py",
        'std = cfg.get("image_std", [0.5] * n_channels) if normalize else [1.0] * n_channels',
        'std = cfg.get("image_std", [0.5] * n_channels) if normalize else [1.0, 1.0, 1.0]',
        (f"{PREPROCESSOR}[greyscale-unnormalized]",)),
    Bug("vit-importer-channels-fixed-at-three", "tserve/model/importers/vit.py",
        'n_channels=raw.get("num_channels", 3)', "n_channels=3", (GREY_SERVED, GREY_BARE)),
    Bug("do-rescale-false-ignored", "tserve/model/preprocessing.py",
        'rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else 1.0',
        'rescale = float(cfg.get("rescale_factor", 1 / 255))',
        (f"{PREPROCESSOR}[greyscale-pixel-scale]", f"{PREPROCESSOR}[rgb-pixel-scale]")),
    Bug("vit-layer-norm-eps-under-gpt2s-name", "tserve/model/importers/vit.py",
        'norm_eps=raw.get("layer_norm_eps", 1e-12)', 'norm_eps=raw.get("layer_norm_epsilon", 1e-12)',
        (GREY_SERVED, GREY_BARE)),
    Bug("oip-pixels-read-channels-last", "tserve/service/vision/served.py",
        'batch = torch.tensor(tensor["data"], dtype=torch.float32).reshape(tensor["shape"])',
        'n, c, h, w = tensor["shape"]\n                batch = torch.tensor(tensor["data"], dtype=torch.float32)'
        ".reshape(n, h, w, c).permute(0, 3, 1, 2)",
        (f"{IMAGES}test_oip_pixels_of_an_rgb_model_are_read_channels_first_as_its_images_are",)),
    Bug("crop-size-read-as-a-dict-only", "tserve/model/preprocessing.py",
        'crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)',
        'crop = (crop["height"], crop["width"])', (f"{PREPROCESSOR}[rgb-integer-crop]",)),
    Bug("deit-embedding-usage-of-one-prefix-token", "tserve/service/routes/embeddings.py",
        "tokens = len(items) * (cfg.n_patches + cfg.n_prefix_tokens)", "tokens = len(items) * (cfg.n_patches + 1)",
        (f"{IMAGE_FAMILIES}test_classifications_and_embeddings_are_transformers[deit]",)),
    Bug("deit-overlay-patches-after-one-token", "tserve/service/routes/attention.py",
        "patches = served.loaded.config.n_prefix_tokens  # where the patches start", "patches = 1  # where the patches start",
        (f"{IMAGE_FAMILIES}test_the_attention_picture_reads_the_class_tokens_attention_to_the_patches[deit]",)),
    Bug("oip-probabilities-placed-by-class-name", "tserve/service/vision/served.py",
        "                row[prediction.index] = prediction.score",
        "                row[self.loaded.labels.index(prediction.label)] = prediction.score",
        (f"{IMAGES}test_classes_that_share_a_name_keep_their_own_probabilities_on_both_protocols",)),
    # Translator families beside the features their tests run on a one-pair translator.
    Bug("nllb-glossary-terms-encoded-with-the-source-code", TRANSLATION_INPUT,
        "self.tokenizer.encode_target(term, add_special_tokens=False) if t != eos]",
        "self.tokenizer.encode_target(term) if t != eos]",
        (f"{TRANSLATORS}test_a_glossary_on_nllb_places_the_term_after_the_target_code_as_beams_would",)),
    Bug("constrained-beams-skip-the-logits-pipeline", "tserve/model/decoding/top_tokens.py",
        "return type(searches[0]).advance_many(searches, pipeline.constrain(torch.log_softmax(scores, -1), rows))",
        "return type(searches[0]).advance_many(searches, torch.log_softmax(scores, -1))",
        (f"{TRANSLATORS}test_a_glossary_on_nllb_places_the_term_after_the_target_code_as_beams_would",)),
    Bug("every-rows-forced-first-token-allowed-to-each", "tserve/model/decoding/logits.py",
        "only[torch.arange(len(forced), device=dev), tokens] = 0.0", "only[:, tokens] = 0.0",
        (f"{TRANSLATORS}test_greedy_and_beam_rows_of_one_batch_each_start_with_their_own_target_code",)),
    Bug("requested-max-tokens-leave-out-the-target-code", TRANSLATION_INPUT,
        "                                  max_tokens or self._default_max_tokens(), self.forced_first(languages))",
        "                                  (max_tokens and max_tokens + bool(self.tokenizer.target_prefix(languages)))"
        " or self._default_max_tokens(), self.forced_first(languages))",
        (f"{TRANSLATORS}test_max_tokens_on_nllb_counts_the_target_code_as_generate_does",)),
    Bug("job-max-tokens-leave-out-the-target-code", "tserve/model/decoding/seq2seq_runner.py",
        "                          max_new_tokens or min(g.max_new_tokens, cfg.max_target_len),\n",
        "                          (max_new_tokens or min(g.max_new_tokens, cfg.max_target_len)) + "
        "(forced_first_token is not None),\n",
        ("tests/model/test_m2m100.py::test_m2m100_layout_tokenizer_and_logits",
         f"{TRANSLATORS}test_max_tokens_on_nllb_counts_the_target_code_as_generate_does")),
    Bug("encoder-reuse-keyed-without-the-t5-tag", "tserve/model/decoding/seq2seq_runner.py",
        "    return tuple(job.source_ids)\n", "    return (job.forced_first_token, *job.source_ids[1:])\n",
        ("tests/http/test_t5_http.py::test_the_translation_memory_answers_each_target_as_a_fresh_translation_would",
         f"{TRANSLATORS}test_an_identical_text_into_another_target_on_t5_is_encoded_with_its_own_tag")),
    Bug("alignment-teacher-forced-without-the-target-code", "tserve/service/translation/served.py",
        "        target_ids = [t for t in pick.token_ids if t != eos]\n",
        "        target_ids = [t for t in pick.token_ids if t != eos and t not in tokenizer.special_ids]\n",
        ("tests/http/test_multilingual_http.py::test_html_tags_follow_their_words",
         f"{TRANSLATORS}test_nllb_word_alignments_read_the_target_code_as_the_decoder_did")),
    Bug("given-target-encoded-with-the-source-specials", TRANSLATION_INPUT,
        "        return [*prefix, *self.tokenizer.encode(text, add_special_tokens=False)]",
        "        return [*prefix, *self.tokenizer.encode(text)]",
        (f"{TRANSLATORS}test_nllb_attention_of_a_given_target_is_transformers_on_the_code_and_its_words",)),
    Bug("document-segment-ids-without-their-language", TRANSLATION_INPUT,
        "            ids[segment] = self.encode_source(segment, languages)\n",
        "            ids[segment] = self.tokenizer.encode(segment)\n",
        ("tests/http/test_multilingual_http.py::test_alternatives_documents_glossary_and_oip",
         f"{TRANSLATORS}test_an_identical_text_into_another_target_on_t5_is_encoded_with_its_own_tag")),
    Bug("t5-tag-takes-the-first-words-characters", "tserve/model/alignment.py",
        "        to_text = [0] * (len(decoded) + 1)\n", "        to_text = list(range(len(decoded) + 1))\n",
        (f"{TRANSLATORS}test_the_t5_tag_in_front_of_a_source_covers_none_of_its_words",)),
    # Where a setting comes from.
    Bug("boolean-flags-default-beats-the-environment", "tserve/service/cli.py",
        "dest=name, default=None, **_flag_type(field),",
        "dest=name, default=default if field.annotation is bool else None, **_flag_type(field),", (EVERY_SETTING,)),
    Bug("run-time-load-on-the-default-attention-backend", REGISTRY,
        "served = self._load_one(name, path, device, resolve_backend(self.settings.attention_backend, device))",
        'served = self._load_one(name, path, device, resolve_backend("auto", device))',
        (f"{SOURCES}test_a_model_loaded_at_run_time_is_built_with_the_servers_settings",)),
    Bug("kb-read-as-kib", SETTINGS, '"kb": 10**3,', '"kb": 2**10,',
        (f"{SOURCES}test_every_size_unit_reads_as_documented_from_flags_and_from_the_environment",)),
    Bug("the-whole-free-memory-refused-as-a-share", SETTINGS,
        "if not 0 < fraction <= 1:", "if not 0 < fraction < 1:",
        (f"{SOURCES}test_a_fraction_up_to_the_whole_free_memory_is_a_kv_cache_share[1.0]",)),
    Bug("cors-origins-variable-decoded-as-json", SETTINGS,
        "    cors_origins: Annotated[list[str], NoDecode] = Field(", "    cors_origins: list[str] = Field(",
        (EVERY_SETTING,)),
    Bug("python-m-tserve-exit-status-lost", "tserve/__main__.py", "sys.exit(main())", "main()",
        ("tests/deploy/test_cli_docs.py::test_unknown_checkpoint_ends_the_process",)),
    Bug("ray-cpu-replica-drops-its-settings", "deploy/ray_serve.py",
        'server_settings = server_settings.model_copy(update={"device": "cpu"})',
        'server_settings = Settings(device="cpu")',
        (f"{SOURCES}test_a_ray_replica_without_a_gpu_keeps_its_builder_arguments_and_its_environment",)),
    Bug("optional-settings-flags-not-unwrapped", "tserve/service/cli.py",
        "    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:",
        "    if typing.get_origin(annotation) is typing.Union:",
        ("tests/deploy/test_cli_docs.py::test_flags_override_environment",
         f"{SOURCES}test_a_flag_wins_over_a_variable_of_every_kind")),
    Bug("kv-cache-memory-checked-only-when-a-model-loads", SETTINGS,
        "    def _memory_share(cls, value: str | None) -> str | None:\n        parse_memory_share(value)\n"
        "        return value",
        "    def _memory_share(cls, value: str | None) -> str | None:\n        return value",
        (f"{INVALID_SIZE}[kv-fraction-above-one]", f"{INVALID_SIZE}[kv-no-unit]")),
    Bug("max-model-memory-checked-only-when-a-model-loads", SETTINGS,
        "        if value is not None:\n            parse_bytes(value)\n        return value", "        return value",
        (f"{INVALID_SIZE}[memory-no-unit]", f"{INVALID_SIZE}[memory-negative]")),
    Bug("home-left-unexpanded-in-path-settings", SETTINGS,
        "        if isinstance(value, Path):\n            return value.expanduser()\n",
        "        if isinstance(value, Path):\n            return value\n",
        (f"{SOURCES}test_a_home_directory_in_a_path_setting_is_expanded_from_flags_and_from_the_environment",)),
    # One feature through each protocol.
    Bug("key-at-its-limit-refused-in-openais-shape-on-v2", "tserve/service/security.py",
        '                                      {"Retry-After": "1"}, path=path)',
        '                                      {"Retry-After": "1"})',
        (f"{PROTOCOLS}test_a_key_at_its_limit_is_refused_in_each_protocols_error_shape",)),
    Bug("v2-prompts-bounded-by-max-prompts-times-n", LM_OIP,
        "texts = bytes_elements(tensor, self.settings.max_prompts)",
        "texts = bytes_elements(tensor, self.settings.max_prompts * self.settings.max_n)",
        (f"{PROTOCOLS}test_max_prompts_bounds_prompts_on_v1_and_text_inputs_on_v2",)),
    Bug("v2-images-bounded-by-the-batch-size", "tserve/service/vision/served.py",
        "bytes_elements(tensor, limits.max_prompts)", "bytes_elements(tensor, limits.batch_max_size)",
        (IMAGES_BOUNDED,)),
    Bug("v2-empty-prompt-taken-as-its-bos", LM_OIP,
        "ids = self.loaded.tokenizer.encode(text) if text and len(text) <= limit else []",
        "ids = self.loaded.tokenizer.encode(text) if len(text) <= limit else []",
        (f"{PROTOCOLS}test_an_empty_prompt_is_refused_on_v2_as_on_v1_though_the_tokenizer_adds_a_bos",)),
    Bug("json-images-past-max-prompts", "tserve/service/routes/deps.py",
        '    check_count("images", len(values), max_images)\n    blobs = []', "    blobs = []", (IMAGES_BOUNDED,)),
    Bug("v2-seed-held-to-32-bits", LM_OIP, '"seed": (int, 0, 2**63 - 1)', '"seed": (int, 0, 2**32 - 1)',
        (f"{PROTOCOLS}test_a_64_bit_seed_samples_the_same_text_on_v2_as_on_v1",)),
    Bug("download-errors-in-openais-shape", "tserve/service/errors.py",
        "return path.startswith((OIP_PREFIX, LIBRETRANSLATE_DOWNLOAD_PREFIX)) or path in LIBRETRANSLATE_PATHS",
        "return path.startswith(OIP_PREFIX) or path in LIBRETRANSLATE_PATHS",
        (f"{PROTOCOLS}test_an_unknown_file_is_a_404_in_each_protocols_error_shape",)),
    Bug("a-submitted-context-overflow-is-a-500", LM_OIP,
        "except (QueueFull, ValueError) as exc:", "except QueueFull as exc:",
        (f"{PROTOCOLS}test_a_request_past_the_context_is_a_400_on_completions_chat_and_v2",)),
    Bug("classifications-take-a-model-of-any-task", "tserve/service/routes/classifications.py",
        "served_model(request, body.model, ServedClassifier.task, body.priority)",
        "served_model(request, body.model, None, body.priority)",
        ("tests/http/test_http.py::test_classification_json_and_multipart",)),
    Bug("v2-translator-languages-swapped", "tserve/service/translation/served.py",
        'params.get("source_lang"),\n                             params.get("target_lang"))',
        'params.get("target_lang"),\n                             params.get("source_lang"))',
        ("tests/http/test_t5_http.py::test_t5_translates_through_every_api_as_generate_does",)),
    Bug("embeddings-of-a-named-model-of-another-kind", "tserve/service/routes/embeddings.py",
        "        if served.embeds != kind:", "        if not served.embeds:",
        ("tests/http/test_embeddings.py::test_inputs_are_bounded_and_the_metric_counts_them",)),
    Bug("one-translator-routed-as-several", "tserve/service/routes/translations.py",
        "if body.model is None and served_translators(request) > 1:",
        "if body.model is None and served_translators(request) >= 1:",
        ("tests/http/test_http.py::test_translation_batch_and_stream",)),
    Bug("v2-default-max-tokens-past-the-limit", LM_OIP,
        '    if "max_tokens" not in values:  # the default counts against the limit, as on /v1/completions',
        "    if False:",
        (f"{PROTOCOLS}test_the_default_max_tokens_is_held_to_the_servers_limit_on_v2_as_on_v1",)),
    Bug("v2-translator-ignores-unknown-parameters", "tserve/service/translation/served.py",
        "        if unknown := sorted(set(params) - _OIP_PARAMETERS):", "        if unknown := []:",
        (f"{PROTOCOLS}test_v2_parameters_each_model_kind_does_not_take_are_refused_not_ignored",)),
    Bug("v2-top-k-minus-one-refused", LM_OIP, '"top_k": (int, -1, None)', '"top_k": (int, 0, None)',
        (f"{PROTOCOLS}test_top_k_minus_one_is_no_filter_on_v2_as_on_v1",)),
    # A server of many models beside one of one.
    Bug("default-model-the-first-of-several", REGISTRY,
        "            if len(candidates) == 1:\n                return candidates[0]",
        "            if candidates:\n                return candidates[0]",
        (f"{MANY}test_completions_without_a_model_are_refused_when_two_language_models_are_served",)),
    Bug("file-route-counts-every-model", "tserve/service/routes/files.py",
        "    if model is None and (served_translators(request) > 1 or detect):",
        "    if model is None and (len(reg.models) > 1 or detect):",
        (f"{MANY}test_a_file_without_a_model_is_translated_by_the_only_translator_beside_language_models",)),
    Bug("attention-target-default-counts-language-models", "tserve/service/routes/attention.py",
        "        candidates = [m for m in models if m.scores_targets]",
        "        candidates = [m for m in models if m.has_logit_lens]",
        (f"{MANY}test_attention_of_a_target_without_a_model_is_the_translators_beside_language_models",)),
    Bug("translation-route-counts-every-model", "tserve/service/routes/translations.py",
        "    return sum(isinstance(m, ServedTranslator) for m in ready_registry(request).models.values())",
        "    return len(ready_registry(request).models)",
        ("tests/http/test_http.py::test_translation_batch_and_stream",
         f"{MANY}test_a_translation_without_a_model_is_the_only_translators_beside_language_models")),
    Bug("one-pair-translator-last-named-wins", "tserve/service/translation/routing.py",
        "            pairs.setdefault(served.loaded.languages, served)", "            pairs[served.loaded.languages] = served",
        ("tests/engine/test_translation_routing.py::test_a_pair_some_model_has_never_goes_through_a_pivot[True]",)),
    Bug("compiled-grammars-shared-between-models", "tserve/model/decoding/structured.py",
        "        self._compiled: OrderedDict[str, Any] = OrderedDict()",
        '        self._compiled: OrderedDict[str, Any] = globals().setdefault("_COMPILED", OrderedDict())',
        ("tests/http/test_structured_output_http.py::test_the_openai_clients_parse_helper_gets_a_validated_object",)),
    Bug("max-model-memory-counts-the-largest-only", REGISTRY,
        "        held = sum(held_bytes(m.model) for m in holding)",
        "        held = max((held_bytes(m.model) for m in holding), default=0)",
        ("tests/engine/test_option_combinations_operations.py::test_max_model_memory_counts_the_draft_model",)),
    Bug("target-less-request-counts-pivot-targets", "tserve/service/translation/routing.py",
        "if s == code and len(hops) == 1})", "if s == code})",
        ("tests/engine/test_translation_routing.py::test_without_a_target_the_only_direct_one_of_the_source_is_taken",)),
    # Inputs at the exact edges of a configuration's limits.
    Bug("max-prompts-refuses-exactly-the-limit", "tserve/service/limits.py",
        "    if count > limit:", "    if count >= limit:", (IMAGES_BOUNDED,)),
    Bug("cache-check-refuses-an-exactly-full-pool", "tserve/model/decoding/lm_runner.py",
        "        if need > have:", "        if need >= have:",
        (f"{PAGED}test_a_request_larger_than_the_pool_is_refused_before_it_runs", WINDOW_EXACT)),
    Bug("block-count-one-too-many-at-whole-blocks", "tserve/model/block_pool.py",
        "        return -(-num_tokens // self.block_size)", "        return num_tokens // self.block_size + 1",
        (f"{PAGED}test_a_block_held_by_a_table_is_never_handed_out", WINDOW_EXACT)),
    Bug("a-source-of-exactly-the-limit-refused-as-a-job", TRANSLATION_INPUT,
        "        if len(ids) > self.max_source_len:", "        if len(ids) >= self.max_source_len:",
        (f"{EDGES}test_a_source_of_exactly_the_length_limit_is_one_job_and_one_token_more_is_refused",)),
    Bug("an-image-of-exactly-the-max-pixels-refused", "tserve/service/vision/images.py",
        "            if w * h > max_pixels:", "            if w * h >= max_pixels:",
        ("tests/model/test_option_combinations_images.py::test_the_image_limits_hold_at_their_values_on_every_image_"
         "route[classifications]",)),
    Bug("window-pool-refuses-an-exact-fit", "tserve/model/window_blocks.py",
        "hit * self.block_size) <= self.pool.num_free", "hit * self.block_size) < self.pool.num_free",
        (WINDOW_EXACT,)),
    Bug("window-mask-one-key-too-many", ATTENTION,
        "allowed &= keys > query_positions[:, :, None].clamp(max=key_len - 1) - window",
        "allowed &= keys >= query_positions[:, :, None].clamp(max=key_len - 1) - window",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[gemma3]",)),
    Bug("decode-grows-one-position-short", "tserve/model/decoding/lm_runner.py",
        "self.blocks.grow(seq.table, seq.num_computed + 1 + ahead)", "self.blocks.grow(seq.table, seq.num_computed + ahead)",
        (f"{PAGED}test_a_block_held_by_a_table_is_never_handed_out",)),
    Bug("default-max-tokens-stops-one-short-of-the-context", COMPLETIONS,
        "served.max_len - len(ids)))", "served.max_len - len(ids) - 1))",
        ("tests/engine/test_option_combinations_streaming.py::test_a_chat_without_max_tokens_writes_up_to_the_end_of_the_"
         "context",)),
    Bug("a-whole-block-prompt-names-its-last-block", "tserve/model/block_pool.py",
        "        for i in range((len(token_ids) - 1) // bs):", "        for i in range(len(token_ids) // bs):",
        (f"{EDGES}test_a_prompt_of_whole_blocks_sent_again_reads_its_prefix_and_writes_the_uncached_tokens"
         "[whole-blocks]",)),
    Bug("translation-max-tokens-of-exactly-the-target-limit-refused", "tserve/service/translation/inputs.py",
        "        if ask.max_tokens > max_target_len:", "        if ask.max_tokens >= max_target_len:",
        ("tests/engine/test_translation_engine.py::test_max_model_len_sizes_a_translators_cache_and_limits",)),
    Bug("reserved-rows-hold-back-an-exact-fit", "tserve/service/engine/admission.py",
        "free_rows - needed < reserved_rows", "free_rows - needed <= reserved_rows",
        ("tests/engine/test_admission_policy.py::test_reserved_rows_hold_back_only_a_client_that_already_holds_rows",)),
    Bug("max-queue-takes-one-more", "tserve/service/engine/admission.py",
        "len(groups) >= max_queue:", "len(groups) > max_queue:", ("tests/engine/test_engine.py::test_batcher_queue_limit",)),
]
