"""Planted bugs that bring back the defects fixed on 2026-12-01 (docs/testing/fixed-defects.md): a JSON boolean
read as a number on /v1, attention layers sorted, a glossary term cut in two, a translation page and attention
viewer misled by an answer, adoption and training silent about what they could not do, a PyPI sdist name,
--max-model-memory before --quantize, a seeded row's retried draw. Part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

SCHEMAS = "tserve/service/request_schemas.py"
MAPS = "tserve/model/attention_maps.py"
SEGMENTATION = "tserve/model/segmentation.py"
TRANSLATION_INPUT = "tserve/service/engine/translation_input.py"
ADOPT = "tserve/training/adopt.py"
FETCH = "tserve/training/data/fetch.py"
QUANTIZE = "tserve/model/quantize.py"
GENERATION = "tserve/service/engine/generation.py"
HTTP_SCHEMAS = "tests/http/test_request_layer_schemas.py::"
BOOLEAN = f"{HTTP_SCHEMAS}test_a_boolean_for_a_number_is_refused_with_400_naming_the_field"
LAYER_ORDER = f"{HTTP_SCHEMAS}test_attention_layers_come_back_in_the_order_asked_each_the_layer_it_names"
LAYER_TWICE = f"{HTTP_SCHEMAS}test_a_layer_named_twice_is_a_400_naming_it"
KEPT_SPAN = "tests/model/test_segmentation.py::test_a_kept_span_that_fits_is_never_cut_and_keep_is_asked_only_for_sentences_too_long"
DOCS = "tests/engine/test_option_combinations_documents.py::"
TERM_AT_THE_CUT = f"{DOCS}test_a_glossary_term_where_a_long_sentence_is_cut_stays_whole_and_is_placed"
TERM_IN_A_DOCUMENT = f"{DOCS}test_a_glossary_term_where_a_long_sentence_is_cut_is_placed_in_a_document_of_several"
TERM_TOO_LONG = f"{DOCS}test_a_glossary_term_longer_than_the_models_input_is_a_422_naming_it"
UNJUDGED = ("tests/training/test_request_layer_evaluation.py::"
            "test_adoption_under_a_limit_holding_no_ding_sentence_says_its_chrf_rule_was_not_applied")
TRAIN = "tests/training/test_request_layer_training.py::"
HELD_OUT = f"{TRAIN}test_a_translator_without_a_validation_split_validates_on_pairs_held_out_of_training"
ON_ITSELF = f"{TRAIN}test_an_lm_of_one_text_without_a_validation_split_says_its_validation_is_on_training_text"
PYPI_NAMES = "tests/training/test_request_layer_data.py::test_the_pypi_cache_finds_each_archive_by_its_projects_name_and_version"
PAGES = "tests/http/test_request_layer_pages.py::"
KEEPS_ALTERNATIVES = f"{PAGES}test_a_400_about_the_text_is_shown_and_the_pair_keeps_its_alternatives"
OWN_HEADS = f"{PAGES}test_each_attention_map_offers_its_own_heads"
PARAM = "tests/http/test_request_layer_translation.py::test_a_refusal_of_n_or_num_beams_names_the_field_as_its_param"
FITS_QUANTIZED = ("tests/deploy/test_option_combinations_settings_pairs.py::"
                  "test_a_model_that_fits_once_quantized_loads_under_max_model_memory_and_its_float_weights_do_not")
FORMATS = "tests/model/test_option_combinations_formats.py::"
ESTIMATE = f"{FORMATS}test_the_memory_estimate_of_a_quantized_load_is_what_the_loaded_model_holds"
PADDED_WIDTHS = f"{FORMATS}test_a_quantized_layer_of_widths_its_kernel_pads_holds_what_its_formats_rule_counts"
RETRIED_DRAW = ("tests/engine/test_option_combinations_after_failures.py::"
                "test_a_seeded_request_chosen_again_after_its_batchs_choice_failed_draws_as_alone")

FIXED_DEFECT_BUGS = [
    # /v1 bodies: a JSON boolean where a number goes
    Bug("v1-reads-a-boolean-as-a-number", SCHEMAS,
        '    @field_validator("*", mode="before")\n    @classmethod\n    def _no_boolean_for_a_number',
        '    @classmethod\n    def _no_boolean_for_a_number', (BOOLEAN,)),
    Bug("v1-boolean-in-a-list-read-as-a-number", SCHEMAS, "    if isinstance(value, list | dict):",
        "    if isinstance(value, dict):", (f"{BOOLEAN}[completions-prompt]",)),
    Bug("v1-boolean-for-a-float-read-as-a-number", SCHEMAS,
        'return "an integer" if int in options else "a number" if float in options else None',
        'return "an integer" if int in options else None', (f"{BOOLEAN}[chat/completions-temperature]",)),
    # attention layers in the order asked, each once
    Bug("attention-layers-sorted", MAPS, 'name each layer once")\n    return layers\n',
        'name each layer once")\n    return sorted(layers)\n', (LAYER_ORDER,)),
    Bug("attention-layer-named-twice-dropped", MAPS,
        '    if twice:\n        raise ValueError(f"layers {twice} named more than once: name each layer once")\n',
        "    layers = list(dict.fromkeys(layers))\n", (LAYER_TWICE,)),
    Bug("logit-lens-layers-not-checked-for-repeats", "tserve/service/served.py",
        "        layers = am.layer_selection(body.layers, lens.n_layers(self.loaded))\n",
        "        layers = list(range(lens.n_layers(self.loaded))) if body.layers is None else body.layers\n",
        (f"{LAYER_TWICE}[logit_lens]",)),
    Bug("bertviz-layers-sorted", MAPS, "        return [[m.weights.tolist()] for m in maps if m.module == module]",
        "        return [[m.weights.tolist()] for m in sorted(maps, key=lambda m: m.layer) if m.module == module]",
        (LAYER_ORDER,)),
    # a glossary term where a long sentence is cut
    Bug("cut-falls-inside-a-kept-span", SEGMENTATION,
        "\n                and not any(m.start() < end and start < m.end() for start, end in spans)]", "]",
        (KEPT_SPAN, TERM_AT_THE_CUT, TERM_IN_A_DOCUMENT)),
    Bug("glossary-spans-not-handed-to-the-cut", TRANSLATION_INPUT,
        "doc = split_document(text, fits, keep if glossary else None)", "doc = split_document(text, fits)",
        (TERM_AT_THE_CUT, TERM_IN_A_DOCUMENT)),
    Bug("glossary-term-too-long-for-the-input-dropped-silently", TRANSLATION_INPUT,
        "if not fits(sentence[start:end]) for s in sources]", "if False for s in sources]", (TERM_TOO_LONG,)),
    Bug("cut-between-characters-inside-a-kept-span", SEGMENTATION,
        "            half = min(ends, key=lambda i: abs(i - middle), default=half)\n", "", (KEPT_SPAN,)),
    # adoption and training say what they could not do
    Bug("adoption-card-silent-about-an-unjudged-rule", ADOPT,
        '\n    note += "".join(f" Not judged by {rule}: {why}." for rule, why in not_judged_by.items())', "",
        (UNJUDGED,)),
    Bug("adoption-table-silent-about-an-unjudged-rule", ADOPT,
        'waived = "; ".join(f"{rule} ({why})" for rule, why in r["not_judged_by"].items()) or "-"',
        'waived = "-"', (UNJUDGED,)),
    Bug("adoption-unjudged-chrf-not-named", ADOPT, "for k in new if new[k] is None or old[k] is None}",
        'for k in new if new[k] is None and old[k] is None and k != "ding_chrf"}', (UNJUDGED,)),
    Bug("held-out-texts-trained-on-too", "tserve/training/common.py",
        "        train = [item for item in train if normalise_key(key(item)) not in held]\n", "", (HELD_OUT,)),
    Bug("translator-trains-on-its-held-out-pairs", "tserve/training/translation.py",
        "    train_pairs, valid_pairs, validated_on = validation_items(splits, lambda pair: pair.en)\n",
        "    _, valid_pairs, validated_on = validation_items(splits, lambda pair: pair.en)\n"
        '    train_pairs = splits["train"]\n', (HELD_OUT,)),
    Bug("card-silent-about-its-validation-data", "tserve/training/card.py",
        "        lines += [f\"Validated on {VALIDATED_ON.get(info['validated_on'], info['validated_on'])}.\", \"\"]",
        "        pass", (HELD_OUT, ON_ITSELF)),
    Bug("lm-training-json-silent-about-its-validation-data", "tserve/training/lm.py",
        '"validated_on": validated_on,\n        "data": {"train_chunks"', '"data": {"train_chunks"', (ON_ITSELF,)),
    # the PyPI cache's archive names
    Bug("pypi-sdist-name-split-at-its-first-hyphen", FETCH,
        "        name, version = parse_sdist_filename(file_name)\n        return name, str(version)",
        '        name, _, version = file_name.partition("-")\n'
        '        return canonicalize_name(name), version.removesuffix(".tar.gz").removesuffix(".zip")', (PYPI_NAMES,)),
    Bug("pypi-version-matched-by-prefix", FETCH, "        return Version(found) == Version(wanted)",
        "        return found.startswith(wanted)", (PYPI_NAMES,)),
    # the translation page's alternatives and the viewer's heads
    Bug("page-drops-alternatives-on-any-400-naming-n", "tserve/service/static/translate.js",
        '    return err.param === "n" || err.param === "num_beams";',
        '    return err.param === "n" || err.param === "num_beams" || /num_beams|\\bn\\b/.test(err.message);',
        (KEEPS_ALTERNATIVES,)),
    Bug("decoder-rows-refusal-names-no-param", "tserve/service/engine/translation.py",
        '"server runs (--max-running-requests)", param="num_beams")', '"server runs (--max-running-requests)")',
        (PARAM,)),
    Bug("error-param-not-passed-on", "tserve/service/errors.py",
        'getattr(exc, "code", None) or invalid_code, getattr(exc, "param", None))',
        'getattr(exc, "code", None) or invalid_code)', (PARAM,)),
    Bug("error-body-without-its-param", "tserve/service/errors.py", ' | ({"param": param} if param else {})}', "}",
        (PARAM,)),
    Bug("viewer-heads-of-the-first-map", "tserve/service/static/viewer.js",
        "    const count = map ? map.weights.length : 0;", "    const count = state.answer.maps[0].weights.length;",
        (OWN_HEADS,)),
    Bug("viewer-heads-not-refilled-with-the-layer", "tserve/service/static/viewer.js",
        '  $("layer").addEventListener("change", () => { fillHeads(); render(); });',
        '  $("layer").addEventListener("change", render);', (OWN_HEADS,)),
    Bug("alignment-reads-a-head-its-map-lacks", "tserve/service/static/viewer.js",
        "const crossHead = headOf(cm, head), CW", "const crossHead = head, CW", (OWN_HEADS,)),
    # --max-model-memory of a model --quantize will quantize
    Bug("memory-estimate-keeps-every-float-weight", QUANTIZE, "        if id(m.weight) not in kept:\n",
        "        if True:\n", (f"{ESTIMATE}[tiny-lm-int8-auto]",)),
    Bug("memory-estimate-output-layer-in-the-models-format", QUANTIZE,
        "layer_fmt = OUTPUT_FORMATS.get(fmt, fmt) if m is output_layer else fmt", "layer_fmt = fmt",
        (f"{ESTIMATE}[tiny-lm-int4-auto]", f"{ESTIMATE}[tiny-lm-q4_0-auto]")),
    Bug("memory-estimate-int8-exact-coefficients-halved", QUANTIZE,
        "            return panels + 2 * 4 * out_features\n", "            return panels + 4 * out_features\n",
        (f"{ESTIMATE}[hf-llama-int8-full-exact]",)),
    Bug("memory-estimate-int4-unpadded", QUANTIZE, "        n = out_features + -out_features % _INT4_N_MULTIPLE\n",
        "        n = out_features\n", (f"{PADDED_WIDTHS}[int4]",)),
    Bug("memory-estimate-block-panels-unpadded", "tserve/model/block_quant.py",
        "return _block_bytes(out_features + -out_features % _COLS, in_features, fmt)",
        "return _block_bytes(out_features, in_features, fmt)", (f"{PADDED_WIDTHS}[q8_0]", f"{PADDED_WIDTHS}[q4_0]")),
    Bug("max-model-memory-counts-the-floats-of-a-quantized-load", "tserve/service/registry.py",
        "needed = checkpoint.weight_bytes(path, dtype, s.quantize, s.int8_activations, s.int4_group_size)",
        "needed = checkpoint.weight_bytes(path, dtype)", (f"{FITS_QUANTIZED}[int8]", f"{FITS_QUANTIZED}[q4_0]")),
    # a seeded row chosen again after its batch's choice failed
    Bug("seeded-retry-draws-after-the-failed-batch", GENERATION,
        "            with _draws_undone_on_failure(reqs):\n                chosen = self.runner.choose_later(reqs, logits)\n",
        "            chosen = self.runner.choose_later(reqs, logits)\n",
        (f"{RETRIED_DRAW}[in-order]", f"{RETRIED_DRAW}[async-scheduling]")),
    Bug("seeded-speculative-retry-draws-after-the-failed-batch", GENERATION,
        "        with _draws_undone_on_failure(reqs):  # a failure here runs each row's step again alone (`_isolated`)\n"
        "            tokens, logprobs, where = self.runner.choose_ahead(reqs, drafts, logits)\n",
        "        tokens, logprobs, where = self.runner.choose_ahead(reqs, drafts, logits)\n",
        (f"{RETRIED_DRAW}[speculative]",)),
    Bug("seeded-generator-state-not-put-back", GENERATION, "            generator.set_state(state)\n",
        "            pass\n", (RETRIED_DRAW,)),
]
