"""The benchmark scripts run end to end on tiny shapes, so that none of their columns rots: the GPU benchmark
(on CPU here, ready for a GPU machine), the translation benchmark against HF and CTranslate2, and the image
classification benchmark against HF."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tserve.model.kernels import cpu as cpu_kernels

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_script(name: str):  # noqa: ANN201 - the script as a module
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_benchmark_runs_on_tiny_shapes(tmp_path, capsys):
    bench = bench_script("gpu")
    out = tmp_path / "rows.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--lm-shapes", "gpt2", "tiny-llama", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    what = {(r["section"], r["what"]) for r in rows}
    assert {("lm", "decode step, batch 1"), ("lm", "1 requests at once"), ("lm", "4 requests at once"),
            ("lm tiny-llama", "decode step, batch 1"), ("lm tiny-llama", "4 requests at once"),
            ("translation", "4 sentences, 1 beam"), ("translation", "4 sentences, 4 beams"),
            ("vit", "batch 1"), ("vit", "batch 8")} <= what
    busy = [r for r in rows if r["what"].startswith("device busy")]
    assert {(r["section"], r["what"]) for r in busy} == {
        ("lm", "device busy at 4 requests"), ("lm tiny-llama", "device busy at 4 requests"),
        ("translation", "device busy, 4 sentences, 1 beam"), ("translation", "device busy, 4 sentences, 4 beams")}
    for r in busy:  # on the CPU the column says why there is no figure, rather than a number
        assert r["tserve"] is None and r["note"] == "unavailable: no CUDA activity on cpu"
    for r in (r for r in rows if r not in busy):
        assert r["tserve"] > 0 and r["baseline_value"] > 0
        # The speed-up is >1 when tserve is faster: a ratio of rates, or the inverse ratio of times.
        faster = r["tserve"] / r["baseline_value"] if r["unit"].endswith("/s") else r["baseline_value"] / r["tserve"]
        assert r["speedup"] == pytest.approx(faster), r
    table = capsys.readouterr().out
    assert "| section | what | baseline | tserve | unit | speed-up |" in table
    assert "kernels | skipped" in table


@pytest.mark.slow
def test_engine_overhead_benchmark_separates_the_model_from_the_engine(capsys):
    rows = bench_script("engine_overhead").main(["--batches", "1", "4", "--steps", "12", "--detokenizer-rounds", "1"])
    assert [r.get("requests") for r in rows] == [1, 4, None, None, None]
    assert all(r["stream_us"] > 0 and r["decodes_us"] > 0 for r in rows[2:])  # each pass checked against decode
    for r in rows[:2]:
        assert r["engine_ms"] > 0 and r["model_ms"] > 0
        assert r["own_ms"] == pytest.approx(max(r["engine_ms"] - r["model_ms"], 0.0))
        assert r["per_request_us"] == pytest.approx(r["own_ms"] / r["requests"] * 1e3)
    assert "| requests | engine ms/step |" in capsys.readouterr().out


@pytest.mark.slow
def test_stream_overhead_benchmark_streams_every_request_to_its_end(capsys):
    """Each round's requests ran to their length and [DONE] (checked by the script), and every column is filled."""
    rows = bench_script("stream_overhead").main(["--batches", "1", "4", "--tokens", "8", "--rounds", "2"])
    assert [(r["requests"], r["round"]) for r in rows] == [(1, 0), (1, 1), (4, 0), (4, 1)]
    assert all(r["tok_s"] > 0 and r["loop_us"] > 0 and r["engine_us"] > 0 and 0 < r["chunks"] <= 1 for r in rows)
    assert "| requests | tokens/s | event loop's CPU a token" in capsys.readouterr().out


@pytest.mark.slow  # 2-3 s: the benchmarks' smoke runs are CI's (`make test SLOW=1`)
def test_structured_output_benchmark_times_masks_and_the_engine(capsys):
    out = bench_script("structured").main(["--vocab-sizes", "3000", "--size", "tiny-llama", "--requests", "2",
                                           "--max-tokens", "8"])
    libraries = {r["library"] for r in out["masks"]}
    assert "llguidance" in libraries
    for r in out["masks"]:
        assert r["vocab"] == 3000 and r["steps"] > 10 and r["mask_us_p50"] > 0
    assert sorted(r["constrained"] for r in out["engine"]) == [False, False, True, True]
    assert all(r["tokens"] == 16 for r in out["engine"] if not r["constrained"])
    assert out["ratio"] > 0 and "constrained / free" in capsys.readouterr().out


@pytest.mark.slow  # 4-6 s: three engine runs
def test_kv_cache_benchmark_runs_memory_prefix_and_chat_on_tiny_shapes(tmp_path, capsys):
    out = bench_script("kv_cache").main(["--parts", "memory", "prefix", "chat", "--size", "tiny-llama",
                                         "--memory-requests", "6", "--prefix-requests", "3", "--system-tokens", "80",
                                         "--turns", "2", "--work", str(tmp_path)])
    memory = out["memory"]
    assert memory["finished"] == 6 and memory["peak"] >= 1 and memory["static"] == 2
    off, on = out["prefix"]
    assert off["cached_tokens"] == 0 and on["cached_tokens"] >= 2 * 64  # the two that waited read 4 blocks each
    assert [r["turn"] for r in out["chat"]] == [1, 2, 1, 2] and out["chat"][3]["cached"] > 0
    assert "TTFT p50 off / on" in capsys.readouterr().out


@pytest.mark.slow  # a smoke run (7 s); `make test-slow` and CI run it
def test_kv_cache_benchmark_counts_the_contexts_a_sliding_models_memory_holds(tmp_path, capsys):
    """The window part on the tests' Gemma 3 stand-in (3 layers, 2 of them sliding within 8): its own pool holds
    more whole contexts in the same memory, at a third of the bytes a position."""
    out = bench_script("kv_cache").main(["--parts", "window", "--window-shape", "tiny-gemma3", "--window-context",
                                         "256", "--window-budget", "0.002", "--work", str(tmp_path)])
    whole, budget = out["window"]
    assert whole["contexts"] == 8 == whole["one_pool_contexts"] and whole["budget"] < whole["one_pool_bytes"]
    assert budget["contexts"] > budget["one_pool_contexts"] > 0
    assert 3 * budget["per_token"] == budget["one_pool_per_token"]
    assert "one pool: memory" in capsys.readouterr().out


def test_linear_paths_benchmark_times_both_paths(capsys):
    rows = bench_script("linear_paths").main(["--rows", "1", "8", "--shapes", "64x96", "--rounds", "3"])
    assert [(r["rows"], r["n_in"], r["n_out"]) for r in rows] == [(1, 64, 96), (8, 64, 96)]
    assert all(r["linear_us"] > 0 and r["packed_us"] > 0 for r in rows)
    assert "| rows | in → out |" in capsys.readouterr().out


@pytest.mark.slow  # HF, CTranslate2 and tserve servers in turns: `make test-slow`
def test_translation_benchmark_runs_every_column_on_tiny_shapes(capsys):
    pytest.importorskip("ctranslate2")
    rows = bench_script("translation").main(["--tiny"])
    systems = {(r.system, r.beams) for r in rows}
    for beams in (1, 4):
        assert {("HF generate", beams), ("CTranslate2 float32", beams), ("CTranslate2 int8", beams)} <= systems
        for precision in ("float32", "int8"):
            assert {(f"tserve {precision} HTTP, batches of 4", beams), (f"tserve {precision} HTTP, 4 clients",
                                                                          beams)} <= systems
    assert all(r.tokens > 0 and r.seconds > 0 for r in rows)
    table = capsys.readouterr().out
    assert f"PyTorch kernels at {torch.backends.cpu.get_cpu_capability()})" in table  # the table names its CPU
    assert "| decoding | HF generate | CTranslate2 float32 | CTranslate2 int8 |" in table
    assert "| greedy |" in table and "| 4 beams |" in table
    # both took two turns, and each turn's ratio is printed
    assert re.search(r"4 beams, tserve / CTranslate2 int8, each round: [\d.]+x, [\d.]+x; median [\d.]+x", table)


@pytest.mark.slow
def test_translation_benchmark_runs_nllb_with_the_target_language_forced(capsys):
    pytest.importorskip("ctranslate2")
    rows = bench_script("translation").main(["--tiny", "--model", "nllb", "--beams", "1"])
    assert {r.system for r in rows} >= {"HF generate", "CTranslate2 float32", "CTranslate2 int8",
                                       "tserve float32 HTTP, batches of 4", "tserve int8 HTTP, 4 clients"}
    assert all(r.tokens > 0 and r.seconds > 0 for r in rows)
    assert "NLLB-200 (English -> German)" in capsys.readouterr().out


@pytest.mark.slow  # HF, CTranslate2 and tserve servers in turns: `make test-slow`
def test_vit_benchmark_runs_every_column_on_tiny_shapes(capsys):
    rows = bench_script("vit").main(["--tiny"])
    assert [r.system for r in rows] == ["HF, batch 1", "HF, batch 4", "HF pipeline + FastAPI, 1 client",
                                        "HF pipeline + FastAPI, 4 clients", "tserve HTTP, 1 client",
                                        "tserve HTTP, 4 clients"]
    assert all(r.images >= 8 and r.seconds > 0 for r in rows)
    out = capsys.readouterr().out
    assert "tserve 1 client / HF batch 1:" in out and "tserve / HF pipeline + FastAPI: 1 client" in out
    each_round = re.search(r"tserve / pipeline, 4 clients, each round: ([\d.]+)x, ([\d.]+)x; median ([\d.]+)x", out)
    assert each_round, out  # both servers took two turns
    assert f"PyTorch kernels at {torch.backends.cpu.get_cpu_capability()})" in out


@pytest.mark.slow
def test_documents_benchmark_runs_every_mode(capsys):
    rows = bench_script("documents").main(["--tiny"])
    assert [r.mode for r in rows] == ["one request (the document)", "sentence by sentence", "sentences at once"]
    assert rows[0].requests == 1 and rows[1].requests == rows[2].requests > 5
    assert all(r.seconds > 0 for r in rows)
    assert "| mode | requests | seconds | vs one request |" in capsys.readouterr().out


@pytest.mark.slow
def test_files_benchmark_times_a_file_cold_and_with_the_memory_warm(capsys):
    rows = bench_script("files").main(["--tiny"])
    assert [name for name, _ in rows][1:] == ["first upload", "second upload (translation memory warm)"]
    assert all(seconds > 0 for _, seconds in rows)
    assert "| run | seconds | sentences/s |" in capsys.readouterr().out


@pytest.mark.slow
def test_families_benchmark_times_both_sides_of_each_shape(capsys, tmp_path):
    rows = bench_script("families").main(["--tiny", "--work", str(tmp_path)])
    assert [(r.shape, r.fmt) for r in rows] == [(s, f) for s in ("tiny-gemma3", "tiny-phi3") for f in ("float32", "int8")]
    assert all(r.ms_per_step > 0 and r.hf_ms_per_step > 0 for r in rows)
    from tserve.model.checkpoint import load  # noqa: PLC0415

    loaded = load(tmp_path / "tiny-gemma3")
    assert loaded.config.sliding_layers == [0, 1] and loaded.config.local_rope_base == 10_000.0
    out = capsys.readouterr().out
    assert "| shape | tserve weights | tserve ms/step | transformers float32 ms/step | x transformers |" in out
    assert "CPU:" in out


@pytest.mark.skipif(cpu_kernels.kernel_isa() is None, reason="the block kernels do not run on this CPU")
def test_the_q4_0_product_rate_is_its_blocks_bytes_over_one_calls_time(monkeypatch):
    traffic = bench_script("memory_traffic")
    calls = []
    real = cpu_kernels.extension()

    class Timed:  # the kernels' module, each block_linear call's arguments kept
        def __getattr__(self, name):  # noqa: ANN204
            return getattr(real, name)

        def block_linear(self, x, codes, scales, *rest):  # noqa: ANN001, ANN202
            calls.append((codes.numel(), scales.numel() * scales.element_size(), x.shape))
            return real.block_linear(x, codes, scales, *rest)

    class Clock:  # each call takes 0.125 s
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 0.125
            return self.now

    monkeypatch.setattr(cpu_kernels, "extension", lambda: Timed())
    monkeypatch.setattr(traffic, "time", Clock())
    rate = traffic.product_bandwidth(2, 8, 2)
    codes, scale_bytes, shape = calls[0]
    assert shape == (1, 4096) and codes + scale_bytes >= 7 * 2**20 and len(calls) == 3  # a warm-up call, then 2
    assert rate == pytest.approx((codes + scale_bytes) / 0.125 / 1e9), "the blocks' bytes, codes and scales"


def test_a_cache_lines_round_trip_between_two_cores_is_per_exchange():
    if len(os.sched_getaffinity(0)) < 2 or cpu_kernels.extension() is None:
        pytest.skip("one CPU, or no kernels: no round trip")
    # On a loaded machine a spinning thread can lose its core for a while, so a pair of measurements may be off:
    # up to 10 pairs are taken. A time not divided by the exchanges would be 10x apart in every pair.
    pairs = []
    for _ in range(10):
        few, many = (cpu_kernels.extension().core_round_trip_ns(n, 3) for n in (2000, 20000))
        pairs.append((few, many))
        if 0 < few < 1e5 and 0 < many < 1e5 and 1 / 3 < many / few < 3:
            return
    pytest.fail(f"ten times the exchanges should take the same time each (ns, 2000 and 20000 exchanges): {pairs}")


@pytest.mark.slow  # 20 s: the machine's bandwidth is measured too
def test_roofline_benchmark_measures_bandwidth_bytes_and_steps(capsys):
    rows = bench_script("roofline").main(["--tiny", "--rounds", "2"])
    formats = ["float32", "int8", "int4", "bfloat16"]
    assert [(r.model.split()[0], r.fmt) for r in rows] == [(m, f) for m in ("tiny", "tiny-llama") for f in formats]
    fp32, int8, int4 = rows[0], rows[1], rows[2]
    assert 3.5 < fp32.weight_mb / int8.weight_mb < 4.0  # int8 weights: a quarter of the bytes, plus scales
    assert fp32.weight_mb / int4.weight_mb > 4.0  # half a byte a weight, a scale and zero per 32
    assert fp32.kv_mb == int8.kv_mb == int4.kv_mb > 0
    assert all(r.ms_per_step > 0 and 0 < r.of_triad and r.vs_hf > 0 for r in rows)
    out = capsys.readouterr().out
    assert ("| model | weights | weights MB/step | KV MB/step | ms/step | GB/s | of triad | of product | of read | "
            "x HF float32 |") in out
    assert "CPU:" in out and "2 round(s)" in out
    assert len(re.search(r"triad ([0-9., ]+) GB/s", out).group(1).split(", ")) == 2  # each round's bandwidth
    # Where the block kernels run, each round's Q4_0 product rate, and the step against it; the two CPUs' round trip
    products = re.search(r"Q4_0 product ([0-9.,\- ]+) GB/s", out).group(1).split(", ")
    trips = re.search(r"round trip ([0-9,\- ]+) ns", out).group(1).split(", ")
    assert len(products) == len(trips) == 2
    if cpu_kernels.kernel_isa() is not None:
        assert all(float(p) > 0 for p in products) and all(0 < r.of_product for r in rows)
    if len(os.sched_getaffinity(0)) >= 2 and cpu_kernels.extension() is not None:
        assert all(0 < float(t) < 1e5 for t in trips)


@pytest.mark.slow
def test_int4_linear_benchmark_times_every_format(capsys):
    rows = bench_script("int4_linear").main(["--tiny", "--calls", "5"])
    assert [r[0] for r in rows] == ["64x96", "96x200"] and all(min(r[1:]) > 0 for r in rows)
    assert "| in x out | float32 µs | int8 µs | int4 µs |" in capsys.readouterr().out


def test_speculative_benchmark_times_both_ways_and_the_step_costs(capsys):
    rows, costs, drafts = bench_script("speculative").main(["--tiny"])
    assert [r.workload for r in rows] == ["copy", "continue", "sampled"]
    assert [d.draft for d in drafts] == ["the target itself", "6 layers", "2 layers"]
    assert drafts[0].kept == 1 and drafts[0].tokens_per_step > 2  # its own drafts: every one kept
    assert all(d.step_ms > 0 and 0 < d.break_even(4) <= 1 for d in drafts)
    assert all(r.plain_tps > 0 and r.spec_tps > 0 and 0 <= r.kept <= 1 and r.tokens_per_step >= 1 for r in rows)
    assert [fed for fed, _ in costs] == [1, 2, 3, 5] and all(ms > 0 for _, ms in costs)
    assert "| workload | tokens/s plain | tokens/s speculative |" in capsys.readouterr().out


@pytest.mark.slow
def test_embeddings_benchmark_scores_every_model(tmp_path, capsys):
    figure = tmp_path / "clusters.png"
    rows = bench_script("embeddings").main(["--tiny", "--per-domain", "12", "--figure", str(figure)])
    assert [r.model for r in rows] == ["tiny LM", "tiny translator", "bag of words (reference)"]
    words = rows[-1]  # the made-up domains share no word: word overlap separates them exactly
    assert words.nn_accuracy == 1.0 and words.between == 0.0 and words.within > 0
    for r in rows[:-1]:  # trained fixtures: texts of one domain lie closer together than texts of two
        assert r.within > r.between and r.nn_accuracy > 0.5
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| embedding | nearest neighbour same domain |" in capsys.readouterr().out


def test_block_linear_benchmark_times_every_format(capsys):
    rows = bench_script("block_linear").main(["--tiny", "--rows", "1", "9", "--calls", "2"])
    assert [(r["shape"], r["rows"]) for r in rows] == [(s, m) for s in ("64x96", "96x200") for m in (1, 9)]
    assert all(min(r["us"].values()) > 0 and min(r["gb_s"].values()) > 0 for r in rows)
    assert "| in x out | rows | int8 µs | int4 µs | Q8_0 µs | Q4_0 µs |" in capsys.readouterr().out


@pytest.mark.slow  # 6 s: a fused and a layer-by-layer model in three formats
@pytest.mark.kernels
def test_block_linear_benchmark_times_decode_steps_layer_by_layer_and_fused(tmp_path, capsys):
    rows = bench_script("block_linear").main(["--tiny", "--fused", "--repeats", "1", "--new", "9", "--work",
                                              str(tmp_path)])
    result = rows[0]["fused"]
    assert sorted(result) == ["float32", "q4_0", "q8_0"]
    for r in result.values():  # one call through the layers dispatches fewer operators than the layers did
        # (the tiny model's step times are differences of two runs' times: noise here, not checked)
        assert math.isfinite(r["layers_ms"]) and math.isfinite(r["fused_ms"]) and r["fused_ops"] < r["layers_ops"] - 50
    assert "| model | format | layers ms | fused ms | speed-up |" in capsys.readouterr().out


@pytest.mark.slow  # 2 s
def test_int8_linear_benchmark_times_every_activation_scheme(capsys):
    table = bench_script("int8_linear").main(["--rows", "1", "4", "--repeats", "1", "--calls", "2"])
    assert len(table) == 2 * 3
    assert all(r["float32"] > 0 and r["split"] > 0 and r["7bit"] > 0 and r["7bit-weights"] > 0 and r["dynamic7"] > 0
               for r in table)
    assert "| shape | rows | float32 | int8 full | int8 split | int8 7bit | int8 7bit-weights |" in \
        capsys.readouterr().out


def test_load_benchmark_runs_a_llama_family_shape_against_transformers(tmp_path, capsys, monkeypatch):
    bench = bench_script("load")
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # the random checkpoint goes under tmp_path/runs
    runs = bench.main(["--size", "tiny-llama", "--concurrency", "1", "2", "--requests", "2", "--max-tokens", "4",
                       "--prompt-words", "4", "--quantize", "int8", "--hf-dtype", "float32"])
    assert {(r.name, r.concurrency) for r in runs} == {
        ("tserve (HTTP)", 1), ("tserve (HTTP)", 2), ("hf generate, sequential", 1), ("hf generate, sequential", 2),
        ("hf generate, batch of 2", 2)}
    assert all(r.tokens_per_s > 0 for r in runs)
    assert all((r.of_roofline is not None) == r.name.startswith("tserve") for r in runs)
    assert all(r.of_roofline > 0 for r in runs if r.name.startswith("tserve"))
    out = capsys.readouterr().out
    assert "1 clients: tserve / hf generate" in out and "triad bandwidth" in out and "of roofline" in out
    assert f"PyTorch kernels at {torch.backends.cpu.get_cpu_capability()})" in out


def test_the_gpu_lease_summary_reads_the_bundle_and_the_weights_beside_it(tmp_path, capsys):
    import io  # noqa: PLC0415
    import tarfile  # noqa: PLC0415

    def tar_of(files: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name, body in files.items():
                member = tarfile.TarInfo(f"./{name}")
                member.size = len(body)
                tar.addfile(member, io.BytesIO(body))
        return buf.getvalue()

    training = {"steps": 4118, "kept_step": 4000, "validation": [{"step": 4000, "val_loss": 2.79},
                                                                 {"step": 4118, "val_loss": 2.81}]}
    rows = [{"section": "lm", "what": "64 requests at once", "baseline": "HF static batch", "baseline_value": 11143.0,
             "tserve": 15633.0, "unit": "tokens/s", "speedup": 1.403},
            {"section": "lm", "what": "device busy at 64 requests", "baseline": "-", "baseline_value": None,
             "tserve": 71.5, "unit": "% of wall time", "speedup": None, "busy_of_timed_pct": 88.2}]
    junit = (b'<testsuites><testsuite name="pytest" tests="32" failures="1" errors="0" skipped="2">'
             b"</testsuite></testsuites>")
    (tmp_path / "results.tar.gz").write_bytes(tar_of({
        "gpu-tests.xml": junit, "gpu-lm-gpt2-auto.json": json.dumps(rows).encode(),
        "train-records.tar.gz": tar_of({"en-de/training.json": json.dumps(training).encode()}),
        "train.log": b"", "tests.log": b"", "bench.log": b""}))
    (tmp_path / "en-de.safetensors").write_bytes(b"\0" * 2**20)
    bench_script("gpu_lease_summary").main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "| gpu-tests.xml | 29 | 1 | 0 | 2 |" in out and "| kernel-tests.xml | no report |" in out
    assert "| en-de | 4118 | 4000 | 2.790 | 1.0 MiB |" in out and "| lm | - | - | - | missing |" in out
    assert "| lm | 64 requests at once | 11,143.0 | 15,633.0 | tokens/s | 1.40x |" in out
    assert "| lm | device busy at 64 requests | - | 71.500 (timed run: 88.2) | % of wall time | - |" in out
    assert "missing from" not in out


@pytest.mark.slow
def test_decode_attention_benchmark_times_each_path_in_its_own_process(capsys):
    rows = bench_script("decode_attention").main(["--tiny", "--positions", "40", "--steps", "2", "--rounds", "1",
                                                  "--sweep-mb", "1"])
    paths = [isa for isa in ("avx2", "avx512") if isa in rows[0]]
    assert paths and all(rows[0][isa][0] > 0 for isa in paths)
    assert "| tiny | 40 |" in capsys.readouterr().out


def test_prefill_benchmark_times_each_attention_path_and_both_backends_of_a_model(tmp_path, capsys):
    out = bench_script("prefill").main(["--tiny", "--formats", "float32", "--work", str(tmp_path)])
    paths = {r["path"] for r in out["attention"]}
    assert {"sdpa"} < paths <= {"sdpa", "avx2", "avx512"}
    assert all(r["ms"] > 0 and r["tokens"] in (40, 70) for r in out["attention"])
    assert {(r["system"], r["tokens"]) for r in out["models"]} == \
        {(f"tserve {b}", n) for b in ("cpu-decode", "sdpa") for n in (40, 70)}
    printed = capsys.readouterr().out
    assert "| tiny | 70 | sdpa |" in printed and "| tiny-llama | float32 | 40 | tserve cpu-decode |" in printed


def test_a_benchmarks_own_working_directory_goes_at_exit_and_a_given_one_stays(tmp_path):
    """A script's scratch space (`bench/scratch.py`): without `--work`, a temporary directory removed when the script
    exits (a roofline run writes ~1 GB); the directory `--work` names is made and kept for the next run."""
    import os
    import subprocess

    given = tmp_path / "given"
    code = ("import sys; from bench.scratch import scratch_dir; own = scratch_dir(None, 'tserve-bench-x-'); "
            "(own / 'model').write_text('x'); kept = scratch_dir(sys.argv[1], 'unused-'); "
            "(kept / 'model').write_text('x'); print(own)")
    out = subprocess.run([sys.executable, "-c", code, str(given)], cwd=BENCH.parent, capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)}, check=True)
    own = Path(out.stdout.strip())
    assert own.parent == tmp_path and own.name.startswith("tserve-bench-x-") and not own.exists()
    assert (given / "model").read_text() == "x"
