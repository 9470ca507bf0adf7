"""Plants known bugs, one at a time, in a copy of the tree and checks that the tests guarding against each
one fail (`make planted-bugs`; not part of `make test`). A bug whose tests still pass means those tests
compare things that would be equal anyway.

    python tests/tools/planted_bugs.py            # every bug, on this CPU's kernels and on AVX2-only ones
    python tests/tools/planted_bugs.py cancel     # the bugs whose name contains "cancel"
    python tests/tools/planted_bugs.py --avx2     # on the AVX2-only kernels alone (--native: this CPU's)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.tools.async_bugs import ASYNC_BUGS  # noqa: E402
from tests.tools.block_kernel_bugs import BLOCK_KERNEL_BUGS  # noqa: E402
from tests.tools.cache_bugs import CACHE_BUGS  # noqa: E402
from tests.tools.checkpoint_bugs import CHECKPOINT_BUGS  # noqa: E402
from tests.tools.combination_bugs import COMBINATION_BUGS  # noqa: E402
from tests.tools.fixed_defect_bugs import FIXED_DEFECT_BUGS  # noqa: E402
from tests.tools.logits_bugs import LOGITS_BUGS  # noqa: E402
from tests.tools.planted_bug import Bug  # noqa: E402
from tests.tools.prefill_attention_bugs import PREFILL_ATTENTION_BUGS  # noqa: E402
from tests.tools.service_bugs import SERVICE_BUGS  # noqa: E402
from tests.tools.tokenizer_bugs import TOKENIZER_BUGS  # noqa: E402
from tests.tools.tooling_bugs import TOOLING_BUGS  # noqa: E402
from tserve.testing.avx2_only import AVX2_ONLY  # noqa: E402

KERNELS = {"native": {}, "avx2": AVX2_ONLY}  # each bug's tests run on both

BUGS = [
    Bug("gemma2-attention-softcap-missing", "tserve/model/attention.py",
        "        scores = torch.tanh(scores / softcap) * softcap", "        pass",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[gemma2]",)),
    Bug("gemma-norm-offset-dropped", "tserve/model/norms.py",
        "            return (normed * (self.offset + self.weight.float())).to(x.dtype)",
        "            return (normed * self.weight.float()).to(x.dtype)",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[gemma3]",
         "tests/model/test_llama_family.py::test_logits_equal_transformers[gemma2]")),
    Bug("sliding-window-one-position-too-wide", "tserve/model/attention.py",
        "        allowed &= keys > query_positions[:, :, None].clamp(max=key_len - 1) - window",
        "        allowed &= keys >= query_positions[:, :, None].clamp(max=key_len - 1) - window",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[gemma3]",
         "tests/model/test_llama_family.py::test_logits_equal_transformers[phi3]")),
    Bug("sliding-padding-queries-see-no-key", "tserve/model/attention.py",
        "        allowed &= keys > query_positions[:, :, None].clamp(max=key_len - 1) - window",
        "        allowed &= keys > query_positions[:, :, None] - window",
        ("tests/model/test_llama_family.py::test_a_short_rows_padding_past_the_window_leaves_no_nan_in_the_cache",)),
    Bug("longrope-short-and-long-factors-swapped", "tserve/model/rope.py",
        "torch.where(positions < original, positions * short[None, :], positions * long[None, :])",
        "torch.where(positions < original, positions * long[None, :], positions * short[None, :])",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[phi3]",
         "tests/model/test_llama_family.py::test_longrope_past_the_original_context_equals_transformers")),
    Bug("gemma3-sliding-layers-rotate-with-the-global-base", "tserve/model/decoder.py",
        "                layer_rotary = local_rotary or rotary", "                layer_rotary = rotary",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[gemma3]",)),
    Bug("granite-residual-multiplier-ignored", "tserve/model/layers.py",
        "        self.residual_multiplier = cfg.residual_multiplier", "        self.residual_multiplier = 1.0",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[granite]",)),
    Bug("phi3-gate-and-up-halves-swapped", "tserve/model/importers/phi3.py",
        "        gate, up = hf[f\"{theirs}.mlp.gate_up_proj.weight\"].chunk(2, dim=0)",
        "        up, gate = hf[f\"{theirs}.mlp.gate_up_proj.weight\"].chunk(2, dim=0)",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[phi3]",)),
    Bug("smollm3-nope-layers-rotate", "tserve/model/attention.py",
        "            if rotary is not None and self.rotates:", "            if rotary is not None:",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[smollm3]",)),
    Bug("deit-teacher-head-ignored", "tserve/model/vit.py",
        "        if self.head_dist is not None:", "        if False:",
        ("tests/model/test_hf_parity.py::test_image_classifier_logits_and_top5", "tests/http/test_image_families_http.py::test_classifications_and_embeddings_are_transformers")),
    Bug("deit-class-and-distillation-tokens-swapped", "tserve/model/vit.py",
        "prefix = [self.cls_token] if self.dist_token is None else [self.cls_token, self.dist_token]",
        "prefix = [self.cls_token] if self.dist_token is None else [self.dist_token, self.cls_token]",
        ("tests/model/test_hf_parity.py::test_image_classifier_logits_and_top5",)),
    Bug("lm-decode-reads-another-requests-kv-slot", "tserve/model/decoding/lm_runner.py",
        "        rows = [s.slot for s in seqs]  # each sequence's own cache row",
        "        rows = [s.slot for s in seqs][1:] + [s.slot for s in seqs][:1]",
        ("tests/engine/test_engine.py::test_greedy_alone_equals_among_fifty_others",
         "tests/engine/test_engine.py::test_a_fault_in_one_request_leaves_the_others_identical",
         "tests/http/test_http.py::test_concurrent_streams_equal_sequential")),
    Bug("speculative-sampled-drafts-kept-unchecked", "tserve/model/decoding/speculative.py",
        "        if j == len(draft) or tokens[-1] != draft[j]:", "        if j == len(draft):",
        ("tests/engine/test_speculative.py::test_seeded_sampled_requests_draw_what_they_draw_without_speculation",
         "tests/engine/test_speculative.py::test_sampled_tokens_have_the_models_distribution",
         "tests/engine/test_draft_model.py::test_the_output_is_the_targets_own_with_a_draft_model_that_often_disagrees[layers-1.0]")),
    Bug("speculative-sampled-positions-drawn-from-the-first-scores", "tserve/model/decoding/speculative.py",
        "tokens.append(draw(probs[j], generator))", "tokens.append(draw(probs[0], generator))",
        ("tests/engine/test_speculative.py::test_seeded_sampled_requests_draw_what_they_draw_without_speculation",)),
    Bug("speculative-drafts-from-the-earliest-occurrence", "tserve/model/decoding/speculative.py",
        "self._ends[tuple(tokens[end - n:end])] = end", "self._ends.setdefault(tuple(tokens[end - n:end]), end)",
        ("tests/engine/test_speculative.py::test_a_draft_is_what_followed_the_latest_occurrence_of_the_longest_suffix",)),
    Bug("speculative-rejected-drafts-never-pause", "tserve/model/decoding/speculative.py",
        "                seq.resume_at = seq.num_generated + PAUSE_TOKENS\n", "                pass\n",
        ("tests/engine/test_speculative.py::test_drafting_pauses_after_mostly_rejected_drafts_and_resumes_later",)),
    Bug("speculative-draft-positions-see-the-current-count", "tserve/model/decoding/speculative.py",
        "self.params, self.num_generated = seq.params, seq.num_generated + j",
        "self.params, self.num_generated = seq.params, seq.num_generated",
        ("tests/engine/test_speculative.py::test_every_sampling_and_stopping_option_gives_with_drafts_what_it_gives_without",)),
    Bug("speculative-row-limit-ignored", "tserve/model/decoding/lm_runner.py",
        "if spec is None or len(seqs) > spec.max_rows:", "if spec is None:",
        ("tests/engine/test_speculative.py::test_no_drafts_beyond_the_row_limit",)),
    Bug("bfloat16-counted-native-on-avx2-kernels", "tserve/model/checkpoint.py",
        'return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and (',
        'return torch.backends.cpu.get_cpu_capability().startswith("AVX") and (',
        ("tests/model/test_checkpoint.py::test_bfloat16_on_kernels_held_to_avx2_loads_with_a_note_that_it_is_emulated",)),
    Bug("int4-figures-stored-under-int8", "tserve/training/evaluate.py",
        "stored | {QUANTIZED_FIGURES[scheme]: figures}", "stored | {QUANTIZED_FIGURES.get(scheme, 'int8'): figures} "
        "if scheme != 'int4' else stored | {'int8': figures}",
        ("tests/training/test_train.py::test_eval_records_int8_figures_beside_the_float32_ones",)),
    Bug("speculative-greedy-drafts-kept-unchecked", "tserve/model/decoding/speculative.py",
        "while kept < len(d) and greedy_choice[start + kept] == d[kept]:", "while kept < len(d):",
        ("tests/engine/test_speculative.py::test_greedy_output_is_identical_with_speculation_and_drafts_are_both_kept_and_rejected",
         "tests/engine/test_speculative.py::test_the_engine_streams_what_plain_greedy_decoding_gives",
         "tests/engine/test_draft_model.py::test_the_output_is_the_targets_own_with_a_draft_model_that_often_disagrees[layers-0.0]")),
    Bug("speculative-rejected-positions-counted-as-computed", "tserve/model/decoding/lm_runner.py",
        "            n = s.num_computed + 1 + kept\n", "            n = s.num_computed + 1 + len(d)\n",
        ("tests/engine/test_speculative.py::test_greedy_output_is_identical_with_speculation_and_drafts_are_both_kept_and_rejected",
         "tests/engine/test_speculative.py::test_the_engine_streams_what_plain_greedy_decoding_gives")),
    Bug("int4-codes-spread-between-the-extremes-only", "tserve/model/quantize.py",
        "    for _ in range(2):\n        mean_code, mean_weight",
        "    for _ in range(0):\n        mean_code, mean_weight",
        ("tests/model/test_int4.py::test_int4_codes_are_fitted_not_only_spread_between_the_extremes",)),
    Bug("int4-codes-on-3-bits", "tserve/model/quantize.py",
        "    scale = ((groups.amax(dim=-1) - offset) / 15).clamp_min(1e-12)",
        "    scale = ((groups.amax(dim=-1) - offset) / 7).clamp_min(1e-12)",
        ("tests/model/test_int4.py::test_int4_codes_are_fitted_not_only_spread_between_the_extremes",
         "tests/model/test_quantize.py::test_int4_translator_on_the_test_split")),
    Bug("int4-scale-and-zero-swapped", "tserve/model/quantize.py",
        "torch.stack([scales, zeros], dim=-1)", "torch.stack([zeros, scales], dim=-1)",
        ("tests/model/test_int4.py::test_an_int4_layer_computes_the_weight_its_codes_encode",
         "tests/model/test_int4.py::test_every_linear_layer_holds_int4_weights_but_the_output_layer_int8[lm]")),
    Bug("int4-padding-columns-read-as-outputs", "tserve/model/quantize.py",
        "out = out[:, : self.out_features].float()", "out = out[:, -self.out_features :].float()",
        ("tests/model/test_int4.py::test_an_int4_layer_computes_the_weight_its_codes_encode",)),
    Bug("int4-output-layer-int4", "tserve/model/quantize.py",
        "output = getattr(model, OUTPUT_LAYER, None)", "output = getattr(model, 'output', None)",
        ("tests/model/test_int4.py::test_every_linear_layer_holds_int4_weights_but_the_output_layer_int8[lm]",
         "tests/model/test_int4.py::test_every_linear_layer_holds_int4_weights_but_the_output_layer_int8[mt]",
         "tests/model/test_quantize.py::test_int4_next_tokens_agree_with_float32s_with_the_output_layer_int8")),
    Bug("config-json-overrides-generation-config-json", "tserve/model/importers/base.py",
        '    return dict(raw) | (read_json(path / "generation_config.json", required=False) or {})',
        '    return (read_json(path / "generation_config.json", required=False) or {}) | dict(raw)',
        ("tests/model/test_llama_family.py::"
         "test_generation_config_json_says_which_ids_end_a_sequence_where_config_json_disagrees",)),
    Bug("special-tokens-map-read-beside-a-newer-config", "tserve/model/tokenizer.py",
        '        if "added_tokens_decoder" not in config:  # an older save',
        '        if True:  # an older save',
        ("tests/model/test_tokenizer.py::test_disagreeing_tokenizer_files_read_as_transformers_reads_them",)),
    Bug("config-special-flags-ignored", "tserve/model/tokenizer.py",
        '                  if isinstance(t, dict) and t.get("special")}',
        '                  if False}',
        ("tests/model/test_tokenizer.py::test_disagreeing_tokenizer_files_read_as_transformers_reads_them",)),
    # The one-request path runs the same runner, so only a reference outside it (transformers) catches this.
    Bug("beams-keep-their-own-cache-rows", "tserve/model/decoding/seq2seq_runner.py",
        "                    src.append(old[p])\n", "                    src.append(new[j])\n",
        ("tests/model/test_hf_parity.py::test_marian_beam_search_identical",
         "tests/engine/test_translation_engine.py::test_marian_parity_through_the_engine")),
    Bug("translation-reads-the-first-requests-source", "tserve/model/decoding/seq2seq_runner.py",
        "crosses += [s.cross_slot] * n", "crosses += [seqs[0].cross_slot] * n",
        ("tests/engine/test_translation_engine.py::test_forty_mixed_requests_equal_each_alone",)),
    Bug("sampling-uses-the-first-requests-generator", "tserve/model/decoding/sampler.py",
        "exponential_noise(probs.size(-1), generators[i])", "exponential_noise(probs.size(-1), generators[sampled[0]])",
        ("tests/model/test_generation.py::test_seeded_sampling_is_independent_of_batch_neighbours",
         "tests/engine/test_engine.py::test_sampled_requests_with_penalties_and_bias_alone_equal_among_others")),
    Bug("logit-bias-ignored", "tserve/model/decoding/logits.py",
        "        if not entries:\n", "        if True:\n",
        ("tests/model/test_generation.py::test_logit_bias_forces_and_bans_in_its_own_row_only",
         "tests/engine/test_engine.py::test_logit_bias_forces_and_bans_beside_unbiased_requests",
         "tests/http/test_http_decoding.py::test_logit_bias_over_http_forces_bans_and_leaves_neighbours_alone")),
    Bug("logit-bias-lands-on-the-first-row", "tserve/model/decoding/logits.py",
        "return scores.index_put((to_device(i, dev), to_device(t, dev)),",
        "return scores.index_put((to_device(i, dev) * 0, to_device(t, dev)),",
        ("tests/engine/test_engine.py::test_logit_bias_forces_and_bans_beside_unbiased_requests",)),
    Bug("beam-rows-read-another-sources-keys", "tserve/model/kv_cache.py",
        "positions[row] = u * width + g", "positions[row] = u * width",
        ("tests/model/test_models.py::test_rows_sharing_a_source_attend_to_it_as_one_query_block",)),
    Bug("packed-linear-drops-its-bias", "tserve/model/packed_linear.py",
        "_onednn_linear(x, self.packed_weight, self.bias)", "_onednn_linear(x, self.packed_weight, None)",
        ("tests/model/test_packed_linear.py::test_packed_linear_layers_compute_what_nn_linear_computes",)),
    Bug("document-layout-becomes-spaces", "tserve/model/segmentation.py",
        "parts += [text, after]", "parts += [text, \" \"]",
        ("tests/model/test_segmentation.py::test_sentences_and_layout",
         "tests/http/test_documents.py::test_a_long_document_keeps_its_layout_and_decodes_in_parallel")),
    Bug("translations-answer-with-the-texts-own-tokens", "tserve/model/decoding/seq2seq_runner.py",
        "best.setdefault(text, (ids, score))", "best.setdefault(text, (tokenizer.encode_target(text), score))",
        ("tests/engine/test_translation_engine.py::test_marian_parity_through_the_engine",)),
    Bug("translations-re-ranked", "tserve/model/decoding/seq2seq_runner.py",
        "for ids, score in self.hypotheses(seq):", "for ids, score in self.hypotheses(seq)[::-1]:",
        ("tests/engine/test_translation_engine.py::test_marian_parity_through_the_engine",
         "tests/http/test_documents.py::test_alternatives_are_the_beams_in_their_order_with_the_scores_they_are_ranked_by")),
    Bug("int8-takes-8-bit-activations-on-every-kernel", "tserve/model/quantize.py",
        "return abs(float(got[0, 0]) - k) < 0.5", "return True",
        ("tests/model/test_quantize.py::test_the_avx2_kernel_gets_full_activations_from_our_exact_gemm",)),
    Bug("int8-7bit-weights-on-8-bits", "tserve/model/quantize.py",
        '_WEIGHT_LEVELS = {"7bit-weights": 63}', '_WEIGHT_LEVELS = {"7bit-weights": 127}',
        ("tests/model/test_quantize.py::test_the_avx2_kernel_gets_full_activations_from_our_exact_gemm",)),
    Bug("int8-split-activations-lose-their-low-half", "tserve/model/quantize.py",
        "torch.add(products[:n], products[n:], alpha=_SPLIT)", "products[n:].mul(_SPLIT)",
        ("tests/model/test_quantize.py::test_an_int8_row_is_the_same_alone_and_beside_a_long_tailed_row",)),
    Bug("gqa-kv-head-mapping-off-by-one", "tserve/model/attention.py",
        "k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)",
        "k, v = k.repeat_interleave(group, dim=1).roll(1, 1), v.repeat_interleave(group, dim=1).roll(1, 1)",
        ("tests/model/test_prefill_attention.py::test_a_models_prefill_and_its_next_steps_on_cpu_decode_equal_sdpa",)),
    Bug("flash-decode-kv-head-of-another-group", "tserve/model/kernels/flash.py",
        "kv_h = h // GROUP", "kv_h = h % GROUP",
        ("tests/model/test_flash_kernels.py::test_grouped_query_family_on_flash_equals_math[qwen3]",
         "tests/model/test_flash_kernels.py::test_lm_decode_step_with_mixed_lengths_on_flash_equals_math[grouping2-flash]")),
    Bug("grammar-mask-lands-on-the-next-row", "tserve/model/decoding/logits.py",
        "idx = to_device([i for i, _ in masked], dev)",
        "idx = (to_device([i for i, _ in masked], dev) + 1) % scores.size(0)",
        ("tests/model/test_structured_output.py::test_constrained_and_free_rows_share_a_batch_and_keep_their_tokens",
         "tests/http/test_structured_output_http.py::test_every_concurrent_answer_that_stops_validates_and_free_ones_do_not[qwen2]")),
    Bug("grammar-not-advanced-after-a-token", "tserve/model/decoding/lm_runner.py",
        "                seq.grammar.advance(token)\n", "                pass\n",
        ("tests/model/test_structured_output.py::test_every_sampled_answer_that_stops_validates[mistral]",
         "tests/model/test_structured_output.py::test_choice_regex_and_grammars[qwen2]",
         "tests/http/test_structured_output_http.py::test_the_openai_clients_parse_helper_gets_a_validated_object[qwen2]")),
    Bug("flash-decode-decodes-through-sdpa", "tserve/model/attention.py",
        "return _flash_module().flash_decode if name in TRITON_BACKENDS else None",
        "return _flash_module().flash_decode if name == \"flash\" else None",
        ("tests/model/test_flash_kernels.py::test_lm_decode_step_with_mixed_lengths_on_flash_equals_math[grouping0-flash-decode]",)),
    Bug("fairseq-positions-with-marians-frequencies", "tserve/model/layers.py",
        'if style == "fairseq":', 'if False:',
        ("tests/model/test_m2m100.py::test_config_and_logits_with_padded_sources",)),
    Bug("forced-target-language-ignored", "tserve/model/decoding/logits.py",
        "is not None and row.num_generated == 0 else None", "is not None and row.num_generated == -1 else None",
        ("tests/model/test_m2m100.py::test_the_forced_code_comes_first_where_the_model_would_choose_another",)),
    Bug("bcp47-region-refused", "tserve/model/language_codes.py",
        '(?:[-_](?P<region>[A-Za-z]{2}|\\d{3}))?"\n                  r"(?:[-_][A-Za-z0-9]{2,8})*")',
        '(?P<region>)"\n                  r"")',
        ("tests/http/test_multilingual_http.py::test_both_directions_in_one_batch_equal_generate",
         "tests/http/test_multilingual_http.py::test_a_one_pair_model_takes_its_own_languages_in_any_spelling")),
    Bug("nllb-legacy-behaviour-ignored", "tserve/model/tokenizer.py",
        'if self._config.get("legacy_behaviour"):', "if False:",
        ("tests/model/test_m2m100.py::test_legacy_behaviour_puts_the_code_last",)),
    Bug("m2m100-language-tokens-in-reverse", "tserve/model/tokenizer.py",
        'self._languages = {f"__{c}__": size + i for i, c in enumerate(codes)}',
        'self._languages = {f"__{c}__": size + len(codes) - 1 - i for i, c in enumerate(codes)}',
        ("tests/model/test_m2m100.py::test_m2m100_layout_tokenizer_and_logits",)),
    Bug("translator-cache-ignores-max-model-len", "tserve/model/decoding/seq2seq_runner.py",
        "self.max_target_len = min(self.cfg.max_target_len, max_len or self.cfg.max_target_len)",
        "self.max_target_len = self.cfg.max_target_len",
        ("tests/engine/test_translation_engine.py::test_max_model_len_sizes_a_translators_cache_and_limits",)),
    Bug("kv-cache-holds-every-query-head", "tserve/model/decoder.py",
        "block_size, self.cfg.kv_heads, self.cfg.d_head,", "block_size, self.cfg.n_heads, self.cfg.d_head,",
        ("tests/model/test_llama_family.py::test_grouped_query_cache_holds_kv_heads_only",
         "tests/http/test_llama_family_http.py::test_twenty_concurrent_greedy_completions_equal_transformers")),
    Bug("shard-names-unchecked", "tserve/model/importers/base.py",
        'if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):',
        "if not isinstance(name, str):",
        ("tests/model/test_llama_family.py::test_sharded_bfloat16_checkpoint",)),
    Bug("rope-scaling-ignored", "tserve/model/rope.py",
        "    kind = scaling_type(scaling)\n    positions", "    kind = 'default'\n    positions",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[llama]",
         "tests/model/test_llama_family.py::test_linear_and_dynamic_rope_scaling_equal_transformers[linear-4.0-100]",
         "tests/model/test_llama_family.py::test_linear_and_dynamic_rope_scaling_equal_transformers[dynamic-2.0-200]")),
    Bug("qk-norm-skipped", "tserve/model/attention.py",
        "if self.q_norm is not None:", "if False:",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[qwen3]",)),
    Bug("qwen2-qkv-bias-dropped", "tserve/model/importers/qwen2.py",
        "qkv_bias=True, out_bias=False", "qkv_bias=False, out_bias=False",
        ("tests/model/test_llama_family.py::test_logits_equal_transformers[qwen2]",)),
    Bug("t5-scores-not-unscaled", "tserve/model/importers/t5.py",
        "query_scale = math.sqrt(cfg.d_head)", "query_scale = 1.0",
        ("tests/model/test_t5.py::test_config_and_logits_with_padded_sources",
         "tests/model/test_t5.py::test_original_t5_layout_tied_and_scaled")),
    Bug("t5-decoder-bias-bidirectional", "tserve/model/seq2seq.py",
        "for bidirectional in (True, False))", "for bidirectional in (True, True))",
        ("tests/model/test_t5.py::test_config_and_logits_with_padded_sources",)),
    Bug("t5-tied-output-not-scaled", "tserve/model/importers/t5.py",
        'output_scale=raw["d_model"] ** -0.5 if scaled else 1.0,', "output_scale=1.0,",
        ("tests/model/test_t5.py::test_original_t5_layout_tied_and_scaled",)),
    Bug("relative-buckets-exact-everywhere", "tserve/model/relative_positions.py",
        "torch.where(distance < max_exact, distance, large)", "torch.where(distance < max_exact, distance, distance.clamp(max=num_buckets - 1))",
        ("tests/model/test_t5.py::test_relative_buckets_equal_transformers",
         "tests/model/test_t5.py::test_config_and_logits_with_padded_sources")),
    Bug("sdpa-drops-the-position-bias", "tserve/model/attention.py",
        "    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,",
        "    mask = mask if mask is None or mask.dtype == torch.bool else torch.isfinite(mask)\n"
        "    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,",
        ("tests/model/test_t5.py::test_position_bias_on_every_cpu_backend",
         "tests/model/test_t5.py::test_config_and_logits_with_padded_sources")),
    Bug("tagged-target-forced-instead", "tserve/model/tokenizer.py",
        "        if languages is None or self.target_tagged:\n            return []",
        "        if languages is None:\n            return []",
        ("tests/http/test_t5_http.py::test_t5_translates_through_every_api_as_generate_does",)),
    Bug("hf-alignment-heads-ignored", "tserve/model/importers/marian.py",
        'alignment_heads=[[int(layer), int(head)] for layer, head in gen.get("alignment_heads") or []],',
        "alignment_heads=[],",
        ("tests/training/test_align_imported.py::test_heads_chosen_on_an_imported_translator_are_written_and_read_back",)),
    Bug("multilingual-alignment-without-languages", "tserve/training/alignment.py",
        "src_ids = tok.source_in(en, languages)", "src_ids = tok.encode(en)",
        ("tests/training/test_align_imported.py::test_heads_chosen_on_an_imported_translator_are_written_and_read_back",)),
    Bug("continued-training-ignores-its-direction", "tserve/training/cli.py",
        "        return f\"{raw['source_lang']}-{raw['target_lang']}\"", "        return None",
        ("tests/training/test_train.py::test_cli_registers_train_and_eval",)),
    Bug("prefix-hash-ignores-the-predecessor", "tserve/model/block_pool.py",
        'hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16)',
        'hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16)',
        ("tests/model/test_paged_kv.py::test_a_block_is_named_after_its_whole_prefix_not_its_own_tokens",)),
    Bug("freed-kv-block-still-referenced", "tserve/model/block_pool.py",
        "            del self._free[block]\n        self._refs[block] += 1\n",
        "            del self._free[block]\n        self._refs[block] = 1\n",
        ("tests/model/test_paged_kv.py::test_a_block_held_by_a_table_is_never_handed_out",
         "tests/engine/test_paged_engine.py::test_a_soak_of_requests_gives_every_block_back")),
    Bug("preempted-request-resumes-from-its-prompt", "tserve/model/decoding/lm_runner.py",
        "        ids = seq.token_ids()\n        names = ",
        "        ids = seq.prompt_ids\n        names = ",
        ("tests/engine/test_paged_engine.py::test_requests_preempted_by_a_small_pool_finish_as_they_would_alone",)),
    Bug("beam-fork-skips-copy-on-write", "tserve/model/block_pool.py",
        "        shared = num_tokens // self.block_size\n", "        shared = -(-num_tokens // self.block_size)\n",
        ("tests/model/test_paged_kv.py::test_a_forked_table_shares_its_full_blocks_and_copies_the_last_partial_one",
         "tests/model/test_hf_parity.py::test_marian_beam_search_identical",
         "tests/engine/test_translation_engine.py::test_marian_parity_through_the_engine")),
    Bug("encoder-output-reused-for-a-source-of-the-same-length", "tserve/model/decoding/seq2seq_runner.py",
        "    return tuple(job.source_ids)\n", "    return (len(job.source_ids),)\n",
        ("tests/engine/test_paged_engine.py::test_an_identical_source_reads_the_encoder_output_of_the_first",)),
    Bug("prefill-after-a-cached-prefix-starts-at-position-0", "tserve/model/decoder.py",
        "            positions = positions + start[:, None]\n", "",
        ("tests/model/test_paged_kv.py::test_a_cached_prefix_is_shared_and_gives_the_logits_of_a_fresh_computation",
         "tests/engine/test_paged_engine.py::test_outputs_with_the_prefix_cache_equal_outputs_without")),
    Bug("draft-cache-counts-the-unfed-draft-token", "tserve/model/decoding/draft_model.py",
        "seq.draft_computed = seq.draft_base + min(kept, seq.draft_len - 1)",
        "seq.draft_computed = seq.draft_base + kept",
        ("tests/engine/test_draft_model.py::test_the_draft_cache_holds_exactly_each_sequences_tokens",
         "tests/engine/test_draft_model.py::test_a_draft_model_with_the_targets_weights_has_every_greedy_draft_kept")),
    Bug("draft-cache-survives-its-release", "tserve/model/decoding/draft_model.py",
        "seq.draft_table, seq.draft_computed, seq.draft_len = None, 0, 0", "seq.draft_table, seq.draft_len = None, 0",
        ("tests/engine/test_draft_model.py::test_the_draft_cache_holds_exactly_each_sequences_tokens",)),
    Bug("draft-catch-up-pads-past-the-context", "tserve/model/decoding/draft_model.py",
        "+ len(feeds[r]) > self.max_len:", "+ len(feeds[r]) > 10**9:",
        ("tests/engine/test_draft_model.py::test_preempted_requests_finish_the_same_and_both_caches_give_every_block_back",)),
    Bug("draft-vocabulary-unchecked", "tserve/model/decoding/draft_model.py",
        "        check_same_vocabulary(target, loaded)\n", "",
        ("tests/engine/test_draft_model.py::test_a_draft_model_of_another_vocabulary_is_refused",
         "tests/http/test_speculative_http.py::test_a_draft_model_of_another_vocabulary_stops_the_server_with_the_reason")),
    Bug("speculative-graph-padding-overwrites-the-last-real-position", "tserve/model/cuda_graphs.py",
        "        positions = [list(range(p, p + W)) for p in starts]",
        "        positions = [list(range(p, p + len(f))) + [p + len(f) - 1] * (W - len(f)) for p, f in zip(starts, fed)]",
        ("tests/model/test_cuda_graphs.py::test_padded_speculative_step_equals_unpadded_step",
         "tests/engine/test_speculative.py::test_steps_padded_to_the_captured_width_and_bucket_give_the_same_output")),
    Bug("speculative-graph-padding-rows-on-a-real-row", "tserve/model/cuda_graphs.py",
        "pad_values=(0, 0, cache.num_rows)", "pad_values=(0, 0, 0)",
        ("tests/model/test_cuda_graphs.py::test_padded_speculative_step_equals_unpadded_step",
         "tests/engine/test_draft_model.py::test_the_draft_cache_holds_exactly_each_sequences_tokens[layers-padded]")),
    Bug("draft-graph-padding-rows-on-a-real-row", "tserve/model/decoding/draft_model.py",
        "pad_values=(0, 0, cache.num_rows)", "pad_values=(0, 0, 0)",
        ("tests/engine/test_draft_model.py::test_the_draft_cache_holds_exactly_each_sequences_tokens[layers-padded]",)),
    Bug("fused-gate-and-fc1-swapped", "tserve/model/layers.py",
        "fused.weight.copy_(torch.cat([self.gate.weight, self.fc1.weight]))",
        "fused.weight.copy_(torch.cat([self.fc1.weight, self.gate.weight]))",
        ("tests/model/test_llama_family.py::test_served_models_compute_gate_and_fc1_as_one_product_with_the_same_outputs",)),
    Bug("load-benchmark-roofline-fraction-unset", "bench/load.py",
        "            r.of_roofline = (weights + r.concurrency * kv) / pct(r.itl, 50) / (triad * 1e9)\n",
        "            pass\n",
        ("tests/deploy/test_bench.py::test_load_benchmark_runs_a_llama_family_shape_against_transformers",)),
    Bug("draft-benchmark-counts-kept-drafts-as-steps", "bench/speculative.py",
        "        steps = new - seq.accepted\n", "        steps = new\n",
        ("tests/deploy/test_bench.py::test_speculative_benchmark_times_both_ways_and_the_step_costs",)),
    Bug("training-saves-every-validation", "tserve/training/loop.py",
        "    if kept is not None and not math.isnan(kept) and (", "    if False and (",
        ("tests/training/test_train.py::test_a_worse_validation_leaves_the_best_checkpoint_on_disk",)),
    Bug("training-periodic-checkpoint-overwrites-the-best", "tserve/training/loop.py",
        "elif save is not None and validate is None and cfg.checkpoint_every",
        "elif save is not None and cfg.checkpoint_every",
        ("tests/training/test_train.py::test_a_worse_validation_leaves_the_best_checkpoint_on_disk",)),
    Bug("training-start-weights-not-kept", "tserve/training/loop.py",
        "    if validate is not None and save is not None and start_checkpoint:", "    if False:",
        ("tests/training/test_train.py::test_which_validations_are_kept",)),
    Bug("vit-training-keeps-the-lowest-loss-not-the-best-accuracy", "tserve/training/vit.py",
        'best_metric="val_accuracy", higher_is_better=True', 'best_metric="val_loss"',
        ("tests/training/test_train.py::test_vit_keeps_its_most_accurate_weights",)),
    Bug("training-without-validation-saves-nothing", "tserve/training/loop.py",
        "    if validate is None and save is not None and saved_at != result.steps:", "    if False:",
        ("tests/training/test_train.py::test_without_validation_the_last_weights_are_saved",)),
    Bug("training-batch-flag-ignored-by-translation", "tserve/training/translation.py",
        "        p = replace(p, batch_tokens=opts.batch)\n", "        pass\n",
        ("tests/training/test_train.py::test_batch_sets_the_examples_of_a_step_for_translation_and_vit",)),
    Bug("training-batch-flag-ignored-by-vit", "tserve/training/vit.py",
        "        p = replace(p, batch_size=opts.batch)\n", "        pass\n",
        ("tests/training/test_train.py::test_batch_sets_the_examples_of_a_step_for_translation_and_vit",)),
    Bug("model-card-hides-the-kept-weights", "tserve/training/card.py",
        "        if kept is not None and kept is not last:", "        if False:",
        ("tests/training/test_train.py::test_translation_checkpoint_translates_and_evaluates",)),
    Bug("int8-weights-on-7-bits", "tserve/model/quantize.py",
        "levels = _WEIGHT_LEVELS.get(activations, 127)", "levels = 63",
        ("tests/model/test_quantize.py::test_each_row_of_an_int8_weight_spans_its_levels",
         "tests/model/test_quantize.py::test_int8_translator_on_the_test_split")),
    Bug("training-dropout-misses-attention", "tserve/training/common.py",
        "            module.dropout = p\n", "            pass\n",
        ("tests/training/test_train.py::test_dropout_reaches_every_layer_of_a_model_trained_without_it",)),
    Bug("training-batch-flag-ignored-by-lm", "tserve/training/lm.py",
        "        p = replace(p, batch_size=opts.batch)\n", "        pass\n",
        ("tests/training/test_train.py::test_lm_training_continues_from_a_checkpoint",)),
    Bug("gguf-q8_0-scale-from-the-next-block", "tserve/model/gguf/tensors.py",
        "    d = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1)\n    q = ",
        "    d = blocks[:, :2].roll(-1, 0).contiguous().view(torch.float16).float()  # (n, 1)\n    q = ",
        ("tests/model/test_gguf.py::test_block_dequantization_is_the_reference[Q8_0]",
         "tests/model/test_gguf.py::test_block_quantized_files_are_served_in_our_formats[llama-Q8_0-q8_0-0.95]")),
    Bug("gguf-q4_0-scale-from-the-next-block", "tserve/model/gguf/tensors.py",
        "    d = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1)\n    packed",
        "    d = blocks[:, :2].roll(-1, 0).contiguous().view(torch.float16).float()  # (n, 1)\n    packed",
        ("tests/model/test_gguf.py::test_block_dequantization_is_the_reference[Q4_0]",
         "tests/model/test_gguf.py::test_block_quantized_files_are_served_in_our_formats[llama-Q4_0-q4_0-0.85]")),
    Bug("gguf-llama-qk-rows-left-permuted", "tserve/model/gguf/tensors.py",
        "        if projection in self._heads:", "        if False:",
        ("tests/model/test_gguf.py::test_f32_file_is_the_original[llama]",
         "tests/model/test_gguf.py::test_f32_file_is_the_original[mistral]",
         "tests/model/test_gguf.py::test_llama_cpp_converted_file_is_the_original[llama]")),
    Bug("gguf-gemma-norms-left-shifted", "tserve/model/gguf/tensors.py",
        "            tensor = tensor - self._family.norm_shift\n", "            tensor = tensor - 0.0\n",
        ("tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[gemma3]",
         "tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[gemma2]",
         "tests/model/test_gguf_families.py::test_files_of_the_test_writer_are_the_model_llama_cpp_runs[gemma3]",
         "tests/model/test_gguf_families.py::test_files_of_the_test_writer_are_the_model_llama_cpp_runs[gemma2]")),
    Bug("gguf-gemma-sliding-pattern-global-first", "tserve/model/gguf/families.py",
        "sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]",
        "sliding = [pattern == 0 or i % pattern != 0 for i in range(n)]",
        ("tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[gemma3]",
         "tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[gemma2]",
         "tests/model/test_gguf_families.py::test_a_stored_sliding_pattern_wins",
         "tests/model/test_gguf_families.py::test_gemma_sliding_layers_and_window_as_llama_cpp_reads_them")),
    Bug("gguf-phi3-rope-factors-swapped", "tserve/model/gguf/families.py",
        '"long_factor": factors["long"].tolist(),\n                               "short_factor": factors["short"]',
        '"long_factor": factors["short"].tolist(),\n                               "short_factor": factors["long"]',
        ("tests/model/test_gguf_families.py::test_llama_cpp_converted_file_is_the_model_llama_cpp_runs[phi3]",
         "tests/model/test_gguf_families.py::test_files_of_the_test_writer_are_the_model_llama_cpp_runs[phi3]")),
    Bug("gguf-fused-qkv-split-in-thirds", "tserve/model/gguf/tensors.py",
        "            head_dim = tensor.shape[0] // (heads + 2 * kv)\n",
        "            heads = kv = 1\n            head_dim = tensor.shape[0] // (heads + 2 * kv)\n",
        ("tests/model/test_gguf_families.py::test_q_k_v_fused_by_the_converter_are_split_again[llama]",
         "tests/model/test_gguf_families.py::test_q_k_v_fused_by_the_converter_are_split_again[qwen2]")),
    Bug("gpu-train-step-brings-back-float32", "bench/gpu_session.sh",
        'if python3 -m tserve.training half "${trained[@]/#/$runs/}"; then', "if true; then",
        ("tests/training/test_gpu_session_train.py::test_the_gpu_train_step_continues_the_bundled_text_models_from_a_data_pack",)),
    Bug("device-busy-sums-overlapping-kernels", "tserve/testing/device_busy.py",
        "        if reach is None or start >= reach:\n            total += end - start",
        "        if True:\n            total += end - start",
        ("tests/deploy/test_device_busy.py::test_overlapping_intervals_count_once",
         "tests/deploy/test_device_busy.py::test_a_profiler_trace_gives_the_device_busy_share_of_the_marked_run")),
    Bug("adopt-installs-a-candidate-no-better", "tserve/training/adopt.py",
        '"installed": better and install}', '"installed": install}',
        ("tests/training/test_adopt.py::test_a_candidate_no_better_than_the_bundled_model_changes_nothing",)),
    Bug("adopt-judges-bleu-alone", "tserve/training/adopt.py",
        "    return new[\"ding_chrf\"] is None or old[\"ding_chrf\"] is None or new[\"ding_chrf\"] >= old[\"ding_chrf\"]",
        "    return True",
        ("tests/training/test_adopt.py::test_better_is_higher_bleu_without_losing_everyday_chrf_or_a_lower_perplexity",)),
    Bug("beam-candidates-scored-by-their-raw-logits", "tserve/model/decoding/top_tokens.py",
        "parts.append((fast, log_probs, ids))", "parts.append((fast, values, ids))",
        ("tests/model/test_top_tokens.py::test_a_translators_greedy_and_beam_results_equal_the_full_log_softmax_path",
         "tests/model/test_top_tokens.py::"
         "test_every_rule_but_the_banned_ids_sends_its_row_down_the_full_path_and_the_rest_take_top_tokens")),
    Bug("a-biased-row-chooses-from-the-raw-logits", "tserve/model/decoding/logits.py",
        "return row.params.penalized or bool(row.params.logit_bias) or", "return row.params.penalized or",
        ("tests/model/test_top_tokens.py::"
         "test_every_rule_but_the_banned_ids_sends_its_row_down_the_full_path_and_the_rest_take_top_tokens",
         "tests/model/test_generation.py::test_rows_whose_constraints_only_rule_ids_out_take_the_argmax_of_the_rest",
         "tests/engine/test_engine.py::test_logit_bias_forces_and_bans_beside_unbiased_requests")),
    Bug("top-tokens-keep-the-banned-ids", "tserve/model/decoding/top_tokens.py",
        "values = values.masked_fill(torch.isin(ids, banned), float(\"-inf\"))", "values = values",
        ("tests/model/test_top_tokens.py::"
         "test_top_tokens_are_topk_and_argmax_of_the_allowed_columns_with_their_log_probabilities",)),
    Bug("gguf-q4_0-blocks-nibble-halves-swapped", "tserve/model/gguf/tensors.py",
        "    return torch.cat([packed & 0x0F, packed >> 4], dim=1), blocks",
        "    return torch.cat([packed >> 4, packed & 0x0F], dim=1), blocks",
        ("tests/model/test_gguf_blocks.py::test_each_layer_holds_the_files_own_blocks[llama-Q4_0]",
         "tests/model/test_gguf_blocks.py::test_each_layer_holds_the_files_own_blocks[qwen2-Q4_0]")),
    Bug("gguf-block-rows-left-permuted", "tserve/model/gguf/tensors.py",
        "        return self._arranged(name, ids.unsqueeze(1))", "        return ids.unsqueeze(1)",
        ("tests/model/test_gguf_blocks.py::test_each_layer_holds_the_files_own_blocks[llama-Q8_0]",
         "tests/model/test_gguf_blocks.py::test_blocks_a_requantization_would_not_give_back_are_kept")),
    Bug("gguf-gpt4o-punctuation-leaves-the-slash", "tserve/model/gguf/tokenizer.py",
        r"""r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|""", r"""r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|""",
        ("tests/model/test_gguf.py::test_named_pre_tokenizers_split_as_the_released_tokenizers[gpt-4o]",)),
    Bug("int8-split-output-keeps-the-high-halves-rows", "tserve/model/kernels/int8_rows.cpp",
        "  return split ? product.narrow(0, 0, N) : product;", "  return product;",
        ("tests/model/test_quantize.py::test_our_row_kernels_give_the_values_of_pytorchs_calls[True-split]",)),
    Bug("large-tensors-in-small-pages", "tserve/__init__.py",
        '_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")', "pass",
        ("tests/model/test_huge_pages.py::test_large_tensors_go_in_huge_pages_unless_the_environment_says_no[None]",)),
    Bug("fused-float32-prefill-on-blas", "tserve/model/checkpoint.py",
        "            onednn_linears(loaded.model)", "            pass",
        ("tests/model/test_packed_linear.py::"
         "test_a_fused_float32_model_runs_its_other_products_on_onednn_over_the_weights_the_fused_step_reads",)),
    Bug("onednn-linear-one-row-on-its-own-kernel", "tserve/model/packed_linear.py",
        "        if x.numel() != self.in_features:", "        if True:",
        ("tests/model/test_packed_linear.py::test_a_row_gets_the_same_result_in_any_batch_on_the_stored_weight_too",)),
    Bug("wide-heads-weigh-their-first-channels-twice", "tserve/model/kernels/paged_decode.cpp",
        "      case 8: weigh_values<8>(v + d, stride,", "      case 8: weigh_values<8>(v, stride,",
        ("tests/model/test_cpu_decode.py::test_kernel_equals_sdpa_over_the_gathered_blocks[avx2-1-4-2-128-16-lengths4]",)),
    Bug("logprobs-0-reports-the-next-tokens", "tserve/model/decoding/sampler.py",
        "        at = log_probs_at(logits, tokens[:, None])",
        "        at = log_probs_at(logits, (tokens[:, None] + 1) % logits.size(-1))",
        ("tests/model/test_top_tokens.py::test_logprobs_0_reports_the_chosen_tokens_own_log_probabilities",)),
]
BUGS += SERVICE_BUGS + CACHE_BUGS + BLOCK_KERNEL_BUGS + ASYNC_BUGS + LOGITS_BUGS + TOKENIZER_BUGS + TOOLING_BUGS \
    + CHECKPOINT_BUGS + COMBINATION_BUGS + PREFILL_ATTENTION_BUGS + FIXED_DEFECT_BUGS

# Where the code is the CPU kernels' (or picks them): a bug planted there must be caught on AVX2-only kernels too,
# by a test that `make test-avx2` runs (marked `kernels`). The Triton kernels (tserve/model/kernels/flash.py) are GPU
# code, run on the CPU by Triton's interpreter, whatever the CPU's kernels.
KERNEL_CODE = ("tserve/model/quantize.py", "tserve/model/packed_linear.py", "tserve/model/block_quant.py") + tuple(
    f"tserve/model/kernels/{name}" for name in ("cpu.py", "int8", "paged_decode", "block_quant", "dense_rows",
                                                "decode_layers", "vector_math", "argmax_rows", "prefill"))

# Which tests each half of CI runs (the Makefile's marker expressions): `make test` natively, `make test-avx2` on
# AVX2-only kernels. A bug's test outside a half's selection does not run in that half here either.
SELECTION = {"native": "not slow", "avx2": "kernels"}


def markers(test: str) -> set[str]:
    """The marker names on a test (`path::name[params]`): its function's and its module's `pytestmark`."""
    import importlib  # noqa: PLC0415

    path, _, name = test.partition("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    marks = [*getattr(getattr(module, name.split("[")[0]), "pytestmark", [])]
    module_marks = getattr(module, "pytestmark", [])
    marks += module_marks if isinstance(module_marks, list) else [module_marks]
    return {m.name for m in marks}


def selected(test: str, half: str) -> bool:
    """Whether the half (`SELECTION`) runs the test."""
    names = markers(test)
    return "slow" not in names if half == "native" else "kernels" in names


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored); models/ is linked, not copied."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if rel.startswith("models/") or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    (dest / "models").symlink_to(ROOT / "models")


def plant(tree: Path, bug: Bug) -> None:
    path = tree / bug.path
    text = path.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the code to change occurs {text.count(bug.old)} times in {bug.path}; "
                         "update tests/tools/planted_bugs.py")
    path.write_text(text.replace(bug.old, bug.new))


def run_tests(tree: Path, tests: tuple[str, ...], kernels: str) -> tuple[dict[str, bool], float]:
    """({test: failed}, seconds), all in one pytest process on `kernels` (`KERNELS`). A test that names a
    module or a parametrized function has failed when any of its cases failed, and every test has when the
    process was killed. The copy comes first on the path, ahead of the installed project."""
    env = {**os.environ, **KERNELS[kernels], "PYTHONPATH": str(tree)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests],
                          cwd=tree, env=env, capture_output=True, text=True)
    failed_ids = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    crashed = proc.returncode < 0  # killed by a signal (a kernel writing out of bounds): failed, as CI sees it
    return {t: crashed or any(f.startswith(t) for f in failed_ids) for t in tests}, time.monotonic() - start


def main(args: list[str]) -> int:
    kernels = [k for k in KERNELS if f"--{k}" in args] or list(KERNELS)
    names = [s for s in args if not s.startswith("--")]
    bugs = [b for b in BUGS if not names or any(s in b.name for s in names)]
    missed, elsewhere = [], []
    print(f"{'bug':48} {'kernels':8} {'test':70} result")
    for bug in bugs:
        with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            plant(tree, bug)
            for k in kernels:
                tests = tuple(t for t in bug.tests if selected(t, k))
                if not tests:  # e.g. a bug in the HTTP layer: no test of it depends on the kernels
                    print(f"{bug.name:48} {k:8} {'(no test of it in this half: ' + SELECTION[k] + ')':70} -")
                    elsewhere.append((bug.name, k))
                    continue
                results, seconds = run_tests(tree, tests, k)
                for test, failed in results.items():
                    print(f"{bug.name:48} {k:8} {test:70} {'caught' if failed else 'MISSED'}", flush=True)
                    if not failed:
                        missed.append((bug.name, k, test))
                print(f"{'':57} ({seconds:.0f} s)")
    print(f"\n{len(bugs)} bugs; {len(missed)} missed" + "".join(f"\n  {b} ({k}): {t}" for b, k, t in missed))
    if elsewhere:
        print(f"{len(elsewhere)} not in a half's selection (their tests do not depend on the kernels): "
              + ", ".join(f"{b} ({k})" for b, k in elsewhere))
    return 1 if missed or any(k == "native" for _, k in elsewhere) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
