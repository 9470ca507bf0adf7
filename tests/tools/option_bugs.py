"""Planted bugs where options meet, a second survey: the served model's and the draft model's quantization options
and the fused step's paths (`tests/model/test_option_combinations_kernels.py`), beside the module tests named. Part of
`tests/tools/combination_bugs.py`'s list, and so of `tests/tools/planted_bugs.py`'s."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

KERNELS = "tests/model/test_option_combinations_kernels.py::"
FUSED = "tests/model/test_fused_decode.py::test_fused_steps_equal_the_layers_steps"
SERVED_LOAD = "quantize=s.quantize,\n                                 int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,"
DRAFT_LOAD = "quantize=s.quantize,\n                                int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,"
GROUP_SIZE = f"{KERNELS}test_an_int4_group_size_reaches_the_served_model_and_its_draft"
ACTIVATIONS = f"{KERNELS}test_int8_activations_reach_the_served_model_and_its_draft"

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
    Bug("gguf-q4_0-output-blocks-requantized", "tserve/model/quantize.py",
        "setattr(model, OUTPUT_LAYER, block_linear(head, Q4_0_OUTPUT))",
        "setattr(model, OUTPUT_LAYER, BlockLinear(head, Q4_0_OUTPUT))",
        ("tests/model/test_gguf_blocks.py::test_each_layer_holds_the_files_own_blocks[llama-Q4_0]",)),
    Bug("given-blocks-read-in-the-asked-format", "tserve/model/quantize.py",
        "return BlockLinear(linear, blocks[2], blocks=blocks[:2])", "return BlockLinear(linear, fmt, blocks=blocks[:2])",
        ("tests/model/test_gguf_blocks.py::test_each_layer_holds_the_files_own_blocks[llama-Q4_0]",)),
]
