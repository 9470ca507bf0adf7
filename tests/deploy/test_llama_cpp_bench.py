"""bench/llama_cpp.py's parts that need no llama.cpp build: its arguments, the llama-server command line, the
build it names from its CMake cache, which prompts each run takes, prompts of a given token count, and the table of
the HTTP runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.llama_cpp import (
    HttpRow,
    amx_tile_hazard,
    llama_build,
    llama_server_argv,
    parse_args,
    prompt_plan,
    prompt_texts,
    render_http_table,
    request_body,
)
from bench.load import Run
from tserve.model.tokenizer import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_http_mode_defaults_to_three_shapes_and_a_quantizer_beside_the_server(tmp_path):
    (tmp_path / "llama-server").touch()
    (tmp_path / "llama-quantize").touch()
    args = parse_args(["--llama-cpp-src", str(tmp_path), "--llama-server", str(tmp_path / "llama-server")])
    assert args.shapes == ["gpt2-small", "smollm2-135m", "qwen2.5-0.5b"]
    assert (args.prompt, args.max_tokens, args.clients, args.formats) == (128, 64, [1, 8], ["float32", "q8_0", "q4_0"])
    tiny = parse_args(["--llama-cpp-src", str(tmp_path), "--llama-server", str(tmp_path / "llama-server"), "--tiny"])
    assert tiny.shapes == ["tiny", "tiny-llama"] and (tiny.prompt, tiny.max_tokens) == (16, 8)
    in_process = parse_args(["--llama-cpp-src", str(tmp_path), "--llama-python", "python"])
    assert in_process.shapes == ["gpt2-small", "smollm2-135m"]


@pytest.mark.parametrize("argv", [[], ["--llama-python", "py", "--llama-server", "BIN"],
                                  ["--llama-server", "BIN", "--clients", "0"]])
def test_arguments_that_name_no_way_both_ways_or_no_client_are_refused(tmp_path, argv):
    (tmp_path / "BIN").touch()
    (tmp_path / "llama-quantize").touch()
    argv = [str(tmp_path / a) if a == "BIN" else a for a in argv]
    with pytest.raises(SystemExit):
        parse_args(["--llama-cpp-src", str(tmp_path), *argv])


def test_a_server_without_llama_quantize_beside_it_is_refused(tmp_path):
    (tmp_path / "llama-server").touch()
    with pytest.raises(SystemExit):
        parse_args(["--llama-cpp-src", str(tmp_path), "--llama-server", str(tmp_path / "llama-server")])


def test_llama_server_gets_the_threads_and_a_context_per_slot():
    argv = llama_server_argv(Path("bin/llama-server"), Path("m.gguf"), 8123, 2, 8, 256)
    flags = dict(zip(argv[1:-1:2], argv[2::2], strict=True))  # then --no-webui
    assert flags["-t"] == flags["-tb"] == "2" and flags["-np"] == "8" and flags["-c"] == str(8 * 256)
    assert (flags["-m"], flags["--port"]) == ("m.gguf", "8123")


CACHE = "GGML_AMX_INT8:BOOL={amx}\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL={avx512}\nGGML_FMA:BOOL=ON\nGGML_NATIVE:BOOL={native}\n"


def test_the_build_is_named_from_its_cmake_cache():
    assert llama_build(CACHE.format(amx="OFF", avx512="OFF", native="OFF")) == "AVX2"
    assert llama_build(CACHE.format(amx="ON", avx512="ON", native="OFF")) == "AMX_INT8 AVX512"
    assert llama_build(CACHE.format(amx="OFF", avx512="OFF", native="ON")) == "native"
    assert llama_build("CMAKE_BUILD_TYPE:STRING=Release\n") == "unknown"


# The statement of `_tile_loadconfig` in GCC 12's amxtileintrin.h (the optimizer sees 8 bytes read) and GCC 13's.
GCC12_TILE_HEADER = '__asm__ volatile ("ldtilecfg\\t%X0" :: "m" (*((const void **)__config)));'
GCC13_TILE_HEADER = "__builtin_ia32_ldtilecfg (__config);"
AMX_CPU = {"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(("amx", "native", "flags", "build_type", "header", "dies"), [
    ("ON", "OFF", AMX_CPU, "Release", GCC12_TILE_HEADER, True),
    ("OFF", "ON", AMX_CPU, "Release", GCC12_TILE_HEADER, True),  # -march=native turns AMX on where the CPU has it
    ("OFF", "ON", AMX_CPU, "", GCC12_TILE_HEADER, True),  # llama.cpp's default build type is Release
    ("OFF", "OFF", AMX_CPU, "Release", GCC12_TILE_HEADER, False),  # the build without AMX runs there
    ("OFF", "ON", AMX_CPU - {"amx_int8"}, "Release", GCC12_TILE_HEADER, False),  # no AMX on this CPU
    ("ON", "OFF", AMX_CPU, "Release", GCC13_TILE_HEADER, False),
    ("ON", "OFF", AMX_CPU, "Release", None, False),  # clang: no such header
    ("ON", "OFF", AMX_CPU, "RelWithDebInfo", GCC12_TILE_HEADER, False),  # -O2 keeps the configuration's stores
], ids=["amx-int8", "native", "native-default-type", "without-amx", "cpu-without-amx", "gcc13", "clang", "o2"])
def test_a_build_whose_amx_tile_configuration_gcc_drops_is_named_before_it_dies(amx, native, flags, build_type,
                                                                                header, dies):
    cache = CACHE.format(amx=amx, avx512="ON", native=native) + f"CMAKE_BUILD_TYPE:STRING={build_type}\n"
    hazard = amx_tile_hazard(cache, flags, header)
    assert (hazard is not None) == dies
    if dies:
        assert "illegal instruction" in hazard and "-DGGML_AMX_INT8=OFF" in hazard and "-DGGML_NATIVE=OFF" in hazard


def test_no_prompt_serves_twice_and_the_check_request_has_its_own():
    plan, count = prompt_plan([1, 8], 2, 3)
    assert [len(r) for r in plan[1]] == [1, 2, 2, 2] and [len(r) for r in plan[8]] == [8, 16, 16, 16]
    taken = [i for ranges in plan.values() for r in ranges for i in r]
    assert sorted(taken) == list(range(count - 1))  # each once; the last is the check request's


@pytest.mark.parametrize("fixture", ["hf-gpt2", "hf-llama"])
def test_each_prompt_is_the_fewest_words_that_reach_the_token_count(fixture):
    tokenizer = load_tokenizer(FIXTURES / fixture)
    texts = prompt_texts(tokenizer, 3, 40)
    assert len(set(texts)) == 3
    for text in texts:
        assert len(tokenizer.encode(text)) >= 40
        assert len(tokenizer.encode(text.rsplit(" ", 1)[0])) < 40


def test_only_tserve_is_named_the_model_and_neither_side_pays_for_logprobs():
    ours, theirs = request_body("a b", 64, True, "tserve"), request_body([1, 2], 64, True, "llama")
    assert ours["model"] == "lm" and "model" not in theirs
    assert {k: v for k, v in ours.items() if k not in ("model", "prompt")} == \
        {k: v for k, v in theirs.items() if k != "prompt"}
    for body in (ours, theirs):
        assert (body["max_tokens"], body["temperature"], body["ignore_eos"], body["stream"]) == (64, 0, True, True)


def test_the_table_gives_each_side_its_rate_itl_and_ttft_and_tserve_over_llama_cpp():
    def run(seconds: float, itl: list[float], ttft: list[float]) -> Run:  # 3 requests of 2 tokens
        return Run("x", 8, seconds=seconds, tokens=6, itl=itl, ttft=ttft, latency=[1.0] * 3)

    rows = [HttpRow("gpt2-small", 8, "q4_0", "Q4_0", run(0.5, [0.05, 0.06, 0.07], [0.11, 0.12, 0.13]),
                    run(1.0, [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]))]
    table = render_http_table(rows).splitlines()
    assert table[0].startswith("| model | clients | tserve | tok/s | ITL p50 | TTFT p50 | llama.cpp | tok/s | ITL p50 |")
    assert table[2] == "| gpt2-small | 8 | q4_0 | 12.0 | 60.0 ms | 120 ms | Q4_0 | 6.0 | 200.0 ms | 500 ms | 2.00x |"
    # A chunk short (a token with no text): the gaps between chunks are not a token's time, so no ITL or TTFT.
    rows[0].tserve.itl.pop()
    assert render_http_table(rows).splitlines()[2] == \
        "| gpt2-small | 8 | q4_0 | 12.0 | - | - | Q4_0 | 6.0 | 200.0 ms | 500 ms | 2.00x |"
