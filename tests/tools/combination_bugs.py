"""Planted bugs where two options meet: a numeric format with an untied output layer or a half precision model, the
fused decode step with Granite's multipliers or Gemma's sliding layers, rope scalings at the edge of their original
context (`tests/model/test_option_combinations_models.py` and the module tests named); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

MODELS = "tests/model/test_option_combinations_models.py::"
GRANITE = f"{MODELS}test_granites_fused_decode_steps_keep_its_embedding_multiplier_and_logits_scaling"
OUTPUT_LAYER = f"{MODELS}test_a_4_bit_formats_output_layer_keeps_8_bits_whether_or_not_it_is_tied"
GEMMA2 = f"{MODELS}test_gemma2s_decode_steps_soft_cap_their_attention_scores_as_the_whole_forward_does"

COMBINATION_BUGS = [
    Bug("int4-untied-output-layer-int4", "tserve/model/quantize.py",
        "    if type(output) is nn.Linear:  # a tied one gets its own int8 copy",
        "    if type(output) is nn.Linear and getattr(getattr(model, 'cfg', None), 'tie_embeddings', True):"
        "  # a tied one gets its own int8 copy",
        (f"{OUTPUT_LAYER}[int4-untied]",)),
    Bug("q4_0-untied-output-layer-in-q4_0", "tserve/model/quantize.py",
        'if fmt == "q4_0" and type(head) is nn.Linear:',
        'if fmt == "q4_0" and type(head) is nn.Linear and model.cfg.tie_embeddings:',
        (f"{OUTPUT_LAYER}[q4_0-untied]",)),
    Bug("fused-step-logits-unscaled", "tserve/model/decoder.py",
        "return self.scale_logits(self.fused.step(tokens, positions, cache, slots))",
        "return self.fused.step(tokens, positions, cache, slots)",
        (f"{GRANITE}[none]", f"{GRANITE}[q8_0]")),
    Bug("fused-step-embeddings-without-the-embedding-multiplier", "tserve/model/fused_decode.py",
        "float(model.embed_scale)", "float(cfg.d_model ** 0.5 if cfg.scale_embeddings else 1.0)",
        (f"{GRANITE}[none]", f"{GRANITE}[q8_0]")),
    Bug("fused-gate-and-fc1-biases-swapped", "tserve/model/layers.py",
        "fused.bias.copy_(torch.cat([self.gate.bias, self.fc1.bias]))",
        "fused.bias.copy_(torch.cat([self.fc1.bias, self.gate.bias]))",
        (f"{MODELS}test_a_gated_mlps_biases_follow_its_gate_and_up_projections_when_served_as_one",)),
    Bug("block-formats-accept-half-precision-models", "tserve/model/quantize.py",
        "    _check_cpu_float32(model, fmt)\n", "",
        (f"{MODELS}test_block_formats_refuse_a_half_precision_model_at_load[q8_0-bfloat16]",
         f"{MODELS}test_block_formats_refuse_a_half_precision_model_at_load[q4_0-float16]")),
    Bug("classic-partial-rotary-factor-ignored", "tserve/model/importers/llama.py",
        'partial = float((scaling or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0)',
        'partial = float((scaling or {}).get("partial_rotary_factor") or 1.0)',
        ("tests/model/test_llama_family.py::test_unsupported_fields_are_named"
         "[partial_rotary_factor-1.5-partial_rotary_factor]",)),
    Bug("longrope-original-position-takes-the-short-factors", "tserve/model/rope.py",
        "torch.where(positions < original,", "torch.where(positions <= original,",
        (f"{MODELS}test_longrope_switches_to_the_long_factors_at_the_original_context",)),
    Bug("softcapped-decode-steps-on-the-uncapped-kernel", "tserve/model/attention.py",
        "            self._attend = functools.partial(math_attention, softcap=self.softcap)\n"
        "            self._cached_decode = None\n",
        "            self._attend = functools.partial(math_attention, softcap=self.softcap)\n",
        (f"{GEMMA2}[as-loaded]", f"{GEMMA2}[as-served]")),
    Bug("gemma3-hub-config-scales-the-sliding-layers-rope", "tserve/model/importers/gemma.py",
        'return (theta, scaling), (float(raw.get("rope_local_base_freq", 10000.0)), None)',
        'return (theta, scaling), (float(raw.get("rope_local_base_freq", 10000.0)), scaling)',
        ("tests/model/test_llama_family.py::test_gemma3_configs_as_the_hub_writes_them_and_its_multimodal_checkpoints"
         "_load_the_same",)),
    Bug("int4-input-padding-on-the-wrong-side", "tserve/model/quantize.py",
        "rows = torch.nn.functional.pad(rows, (0, self._k_pad))", "rows = torch.nn.functional.pad(rows, (self._k_pad, 0))",
        ("tests/model/test_int4.py::test_an_int4_layer_computes_the_weight_its_codes_encode[96-40-64]",)),
    Bug("gguf-auto-blocks-on-half-precision", "tserve/model/checkpoint.py",
        'served = nearest if device.type == "cpu" and dtype == torch.float32 else "none"',
        'served = nearest if device.type == "cpu" else "none"',
        ("tests/model/test_gguf.py::test_an_explicit_quantization_wins_and_auto_keeps_floats_where_ours_cannot_run",)),
    Bug("dynamic-rope-context-not-extended", "tserve/model/importers/llama.py",
        'context = int(context * float(scaling["factor"]))', "context = int(context)",
        (f"{MODELS}test_dynamic_rope_scaling_extends_the_context_a_checkpoint_is_served_for",)),
    Bug("fused-sliding-layers-without-their-own-cache", "tserve/model/fused_decode.py",
        "own = (local.k, local.v, local.tables) if local is not None else (_NONE,) * 3", "own = (_NONE,) * 3",
        ("tests/model/test_window_blocks.py::test_steps_equal_those_of_a_cache_that_keeps_every_position_and_hold_only"
         "_the_window[gemma3-fused-step]",)),
]
