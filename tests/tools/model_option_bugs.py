"""Planted bugs where options meet, the second survey's model-level areas: the translators' scores, stopping rules,
position biases, alignments, default lengths and language codes (`tests/model/test_option_combinations_translators.py`);
GGUF files' end-of-generation ids, pre-tokenizers, mixed and legacy types, alignment, Gemma's sliding rope, fused q/k/v
biases and a named block format (`tests/model/test_option_combinations_gguf.py`); the KV cache's eviction order, decode
lengths, window pool and drafts on sliding layers (`tests/model/test_option_combinations_cache.py`). Part of
`tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

MT_OPTIONS = "tests/model/test_option_combinations_translators.py::"
CODES = "tserve/model/language_codes.py"
GGUF = "tests/model/test_option_combinations_gguf.py::"
GGUF_TOKENIZER = "tserve/model/gguf/tokenizer.py"
GGUF_FAMILIES = "tserve/model/gguf/families.py"
GEMMA_SLIDING_ROPE = f"{GGUF}test_gemma_sliding_layers_rotate_as_llama_cpp_rotates_them"
CACHE = "tests/model/test_option_combinations_cache.py::"

MODEL_OPTION_BUGS = [
    Bug("greedy-score-without-length-penalty", "tserve/model/decoding/seq2seq_runner.py",
        "seq.logprob_sum / max(len(seq.generated), 1) ** self.gen.length_penalty",
        "seq.logprob_sum / max(len(seq.generated), 1)",
        (f"{MT_OPTIONS}test_a_greedy_translations_score_takes_the_checkpoints_length_penalty",)),
    Bug("constrained-running-beam-judged-one-token-longer", "tserve/model/decoding/constrained_beam.py",
        "max(b.score for b in self.beams) / (self.cur_len - 1) ** self.s.length_penalty",
        "max(b.score for b in self.beams) / self.cur_len ** self.s.length_penalty",
        (f"{MT_OPTIONS}test_a_glossary_search_goes_on_exactly_while_a_running_hypothesis_can_still_win",)),
    Bug("script-subtag-case-kept", CODES, 'script = m["language"].lower(), (m["script"] or "").title()',
        'script = m["language"].lower(), (m["script"] or "")',
        (f"{MT_OPTIONS}test_a_script_subtag_picks_the_script_in_any_case",)),
    Bug("t5-decoder-bias-of-the-first-rows-position", "tserve/model/seq2seq.py",
        'mask = self._self_mask("dec", positions, kv_len, causal_mask(positions, kv_len), x.dtype)',
        'mask = self._self_mask("dec", positions[:1], kv_len, causal_mask(positions, kv_len), x.dtype)',
        (f"{MT_OPTIONS}test_t5_rows_at_different_positions_each_read_their_own_position_bias",)),
    Bug("constrained-candidates-of-impossible-tokens", "tserve/model/decoding/constrained_beam.py",
        "            if beam.score <= _NEG / 2 or logp <= _NEG / 2:", "            if beam.score <= _NEG / 2:",
        (f"{MT_OPTIONS}test_a_glossary_token_the_pipeline_ruled_out_never_finishes_a_hypothesis",)),
    Bug("alignment-batch-attends-padding", "tserve/model/alignment.py",
        "        lengths = torch.tensor([len(pairs[i][0]) for i in chunk])",
        "        lengths = torch.tensor([src_len for i in chunk])",
        (f"{MT_OPTIONS}test_word_alignments_of_a_batch_equal_each_sentence_aligned_alone",)),
    Bug("marian-default-length-one-past-max-length", "tserve/model/importers/marian.py",
        'max_new_tokens=int(gen.get("max_new_tokens") or max_length - 1),',
        'max_new_tokens=int(gen.get("max_new_tokens") or max_length),',
        (f"{MT_OPTIONS}test_marians_default_length_is_generates_max_length_less_the_start_token",)),
    Bug("traditional-chinese-short-code-unknown", CODES, '    if code == "zt":\n        return "zh_Hant"\n', "",
        (f"{MT_OPTIONS}test_traditional_chinese_is_found_among_the_short_codes_routes_are_listed_by",)),
    Bug("chinese-region-leaves-the-script-unsaid", CODES,
        '    if not script and language in ("zh", "zho") and (m["region"] or "").upper() in _TRADITIONAL_CHINESE_REGIONS:\n'
        '        script = "Hant"\n', "",
        (f"{MT_OPTIONS}test_traditional_chinese_is_found_among_the_short_codes_routes_are_listed_by",)),
    Bug("gguf-eot-id-not-an-end-of-generation", GGUF_TOKENIZER,
        '("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",', '("tokenizer.ggml.eos_token_id",',
        (f"{GGUF}test_eot_and_eom_ids_of_the_metadata_end_generation",)),
    Bug("gguf-bpe-vocabulary-adds-bos-by-default", GGUF_TOKENIZER,
        'bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))',
        'bool(meta.get("tokenizer.ggml.add_bos_token", True))',
        (f"{GGUF}test_a_file_without_add_bos_token_follows_llama_cpps_default",)),
    Bug("gguf-deepseek-r1-qwen-split-as-llama3", GGUF_TOKENIZER,
        'PRE_TOKENIZERS["deepseek-r1-qwen"] = PRE_TOKENIZERS["qwen2"]',
        'PRE_TOKENIZERS["deepseek-r1-qwen"] = PRE_TOKENIZERS["llama-bpe"]',
        (f"{GGUF}test_pre_tokenizer_aliases_split_as_the_pre_tokenizer_they_name",)),
    Bug("gguf-loaded-model-stops-at-eos-only", "tserve/model/checkpoint.py",
        "GenerationDefaults(eos_token_ids=gguf_file.end_ids())",
        'GenerationDefaults(eos_token_ids=[gguf_file.raw["eos_token_id"]])',
        (f"{GGUF}test_a_gguf_file_ends_generation_wherever_its_original_does",)),
    Bug("gguf-auto-format-counts-embedding-and-output", "tserve/model/gguf/tensors.py",
        'if len(info.shape) == 2 and name.startswith(("model.layers.", "layers.")):', "if len(info.shape) == 2:",
        (f"{GGUF}test_auto_takes_the_type_most_of_the_layers_have_not_the_embedding_and_output",)),
    Bug("gguf-q5_0-served-as-int4", "tserve/model/gguf/tensors.py", 'Q.Q5_0: "int8"', 'Q.Q5_0: "int4"',
        (f"{GGUF}test_legacy_block_types_are_dequantized_and_served_in_the_nearest_format",)),
    Bug("gguf-gemma3-sliding-rope-base-defaults-to-global", GGUF_FAMILIES,
        'float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))',
        'float(meta.get(f"{arch}.rope.freq_base_swa", raw["rope_theta"]))', (GEMMA_SLIDING_ROPE,)),
    Bug("gguf-per-layer-values-take-the-first", GGUF_FAMILIES, "if len(set(value)) != 1:", "if not value:",
        (f"{GGUF}test_per_layer_metadata_is_one_value_only_where_every_layer_has_it",)),
    Bug("gguf-gemma2-sliding-layers-lose-rope-scaling", GGUF_FAMILIES,
        '| ((raw["rope_scaling"] or {}) if gemma2 else {}))', "| {})", (GEMMA_SLIDING_ROPE,)),
    Bug("gguf-custom-alignment-ignored", "tserve/model/gguf/header.py", "            alignment = value\n",
        "            pass\n", (f"{GGUF}test_a_custom_alignment_reads_the_same_tensors",)),
    Bug("hub-gguf-file-name-ignores-revision", "tserve/model/hub.py",
        "return Path(hf_hub_download(repo_id, wanted, revision=revision))", "return Path(hf_hub_download(repo_id, wanted))",
        (f"{GGUF}test_a_file_named_at_a_revision_is_that_revisions",)),
    Bug("hub-quant-name-fetched-in-two-cases-only", "tserve/model/hub.py", "for q in {wanted, quant, wanted.upper()}]",
        "for q in {wanted, quant}]", (f"{GGUF}test_a_quantization_named_in_lower_case_fetches_the_upper_case_file",)),
    Bug("gguf-gemma-end-of-turn-not-an-end", GGUF_TOKENIZER, '"<|im_end|>", "<|end|>", "<end_of_turn>", ',
        '"<|im_end|>", "<|end|>", ', (f"{GGUF}test_a_gguf_file_ends_generation_wherever_its_original_does[gemma3]",)),
    Bug("gguf-fused-qkv-biases-dropped", GGUF_FAMILIES,
        'any(f"blk.0.{n}.bias" in tensors for n in ("attn_q", "attn_qkv"))', '"blk.0.attn_q.bias" in tensors',
        (f"{GGUF}test_a_file_with_q_k_and_v_fused_keeps_their_biases",)),
    Bug("gguf-named-block-format-keeps-the-files-other-format", "tserve/model/gguf/blocks.py",
        "(found := self._encode(ids, weight)) and (self._any_format or found[2] == fmt):",
        "(found := self._encode(ids, weight)):",
        (f"{GGUF}test_a_block_format_named_is_the_one_served_from_a_file_of_the_other",)),
    Bug("release-frees-a-prefix-head-first", "tserve/model/block_pool.py", "for block in reversed(table.blocks):",
        "for block in table.blocks:", (f"{CACHE}test_a_released_prefix_gives_up_its_last_blocks_before_its_first",)),
    Bug("eager-decode-attends-one-position-short", "tserve/model/decoding/lm_runner.py",
        "logits = self.model.decode_step(fed, positions, self.cache, rows, kv_len=max(positions) + 1)",
        "logits = self.model.decode_step(fed, positions, self.cache, rows, kv_len=max(positions))",
        (f"{CACHE}test_steps_over_a_shared_prefix_and_a_fresh_prompt_equal_the_whole_forward_for_each_backend_and_"
         "block_size",)),
    Bug("window-pool-grows-without-the-draft", "tserve/model/decoding/lm_runner.py",
        "if not self.windows.grow(seq.window_table, seq.num_computed + 1 + ahead):",
        "if not self.windows.grow(seq.window_table, seq.num_computed + 1):",
        (f"{CACHE}test_accepted_drafts_on_sliding_layers_leave_the_keys_plain_steps_leave",)),
    Bug("check-ignores-the-window-pool", "tserve/model/decoding/lm_runner.py",
        "have = min(have, self.windows.pool.num_usable)", "have = min(have, self.blocks.num_usable)",
        (f"{CACHE}test_a_request_the_sliding_layers_pool_cannot_hold_is_refused_up_front",)),
]
