"""Planted bugs of what loading a checkpoint decides: a GGUF file's tokenizer and rope settings
(`tserve/model/gguf/`), the model a config builds (`tserve/model/config.py`, `decoder.py`, `layers.py`), and the int8
layers `--quantize int8` makes (`tserve/model/quantize.py`); part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

GGUF = "tests/model/test_gguf.py::"
MODELS = "tests/model/test_models.py::"
LLAMA3 = f"{GGUF}test_llama3_rope_factors_with_no_frequency_between_the_bounds_round_trip"

CHECKPOINT_BUGS = [
    Bug("gguf-user-defined-tokens-made-special", "tserve/model/gguf/tokenizer.py",
        "tok.add_tokens([AddedToken(t, special=False, normalized=False)",
        "tok.add_tokens([AddedToken(t, special=True, normalized=False)",
        (f"{GGUF}test_user_defined_tokens_are_text_and_control_tokens_are_not",)),
    Bug("gguf-turn-ending-control-tokens-not-looked-up", "tserve/model/gguf/tokenizer.py",
        'meta.get("tokenizer.ggml.tokens") or [], meta', 'meta.get("tokens") or [], meta',
        (f"{GGUF}test_user_defined_tokens_are_text_and_control_tokens_are_not",)),
    Bug("llama3-factors-without-ones-read-from-the-wrong-wavelength", "tserve/model/gguf/families.py",
        "if ones else float(wavelens[0])", "if ones else float(wavelens[1])", (f"{LLAMA3}[4]",)),
    Bug("llama3-factors-ignore-the-ones", "tserve/model/gguf/families.py",
        "        ones = [w for w, f in zip(wavelens, factors, strict=True) if np.isclose(f, 1)]", "        ones = []",
        (f"{LLAMA3}[400]",)),
    Bug("int8-layers-not-given-the-activations-asked-for", "tserve/model/quantize.py",
        "return _replace_linears(model, lambda linear: Int8Linear(linear, activations))",
        'return _replace_linears(model, lambda linear: Int8Linear(linear, "full"))',
        tuple(f"tests/model/test_quantize.py::test_the_activations_asked_for_reach_every_layer[{a}]"
              for a in ("split", "7bit", "7bit-weights"))),
    Bug("int8-exact-kernel-output-keeps-only-the-batch-dimension", "tserve/model/quantize.py",
        "                                            self.bias)\n            return out.reshape(*x.shape[:-1],",
        "                                            self.bias)\n            return out.reshape(*x.shape[:1],",
        ("tests/model/test_int8_gemm.py::test_a_layer_on_the_exact_kernel_equals_its_pytorch_statement",)),
    Bug("sliding-layers-lose-their-rope-scaling", "tserve/model/decoder.py",
        "cos, sin = Rotary.tables(rotated, cfg.max_seq_len, cfg.local_rope_base, cfg.local_rope_scaling)",
        "cos, sin = Rotary.tables(rotated, cfg.max_seq_len, cfg.local_rope_base, None)",
        (f"{MODELS}test_the_sliding_layers_rotate_with_their_own_base_and_scaling",)),
    Bug("mlp-bias-setting-ignored", "tserve/model/layers.py",
        "bias = cfg.bias if cfg.mlp_bias is None else cfg.mlp_bias", "bias = cfg.bias",
        (f"{MODELS}test_a_bias_setting_of_the_mlp_overrides_the_models",)),
    Bug("whole-head-rotary-refused", "tserve/model/config.py",
        "not 0 < self.rotary_dim <= self.d_head", "not 0 < self.rotary_dim < self.d_head",
        (f"{MODELS}test_the_rotary_part_may_be_the_whole_head",)),
    Bug("gguf-add-eos-flag-not-read", "tserve/model/gguf/tokenizer.py",
        'bool(meta.get("tokenizer.ggml.add_eos_token", False))', 'bool(meta.get("add_eos_token", False))',
        (f"{GGUF}test_user_defined_tokens_are_text_and_control_tokens_are_not",)),
    Bug("gguf-llama-q-k-biases-kept-in-the-converters-order", "tserve/model/gguf/tensors.py",
        "        if projection in self._heads:", "        if projection in self._heads and name.endswith(\".weight\"):",
        (f"{GGUF}test_a_llama_file_with_attention_and_mlp_biases_is_the_original",)),
    Bug("gguf-value-length-unchecked", "tserve/model/gguf/families.py",
        'if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:', "if False:",
        (f"{GGUF}test_a_llama_file_with_attention_and_mlp_biases_is_the_original",)),
    Bug("int4-output-layer-on-the-default-int8-engine", "tserve/model/quantize.py",
        "        setattr(model, OUTPUT_LAYER, Int8Linear(output, activations, engine=output_layer_engine(activations)))",
        "        setattr(model, OUTPUT_LAYER, Int8Linear(output, activations))",
        ("tests/model/test_quantize.py::test_int4s_output_layer_asks_for_the_output_layers_engine",)),
]
