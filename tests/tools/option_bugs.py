"""Planted bugs where options meet, a second survey: the served model's and the draft model's quantization options
and the fused step's paths (`tests/model/test_option_combinations_kernels.py`); asynchronous scheduling with logprobs,
preemption with the prefix cache and the queue's order, identical prompts at once, call jobs with --max-queue 0, a
fractional KV budget beside a sliding pool, a translator's admission in a small pool and a request's choices toward
--max-queue (`tests/engine/test_option_combinations_scheduling.py`), beside the module tests named. Part of
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
]
