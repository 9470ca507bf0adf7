"""Server settings where two of them meet: --model entries from a flag beside TSERVE_MODELS (the flag wins, the
variable serves when no flag is given) and a name given twice; --max-n beside --max-prompts on the completion and
chat routes; --prompt-lookup-min above --prompt-lookup-max and --speculative-max-rows beside a request of several
rows; --kv-block-size on a language model and on a translator served together; --max-model-memory beside
--quantize int4 (the quantized weights held as buffers count). Apps run in this process (`httpx.ASGITransport`)
on the committed fixture models, so that the tests take seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deploy.test_option_combinations_cli import clean_env, served  # noqa: F401 - fixtures
from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.model import checkpoint
from tserve.model.quantize import held_bytes, is_int8_linear, is_quantized_linear
from tserve.service.cli import build_parser, main, settings_from_args
from tserve.service.errors import APIError
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"
MAX_N, MAX_PROMPTS, BLOCK = 3, 2, 8
# A prompt whose every token occurred before: prompt lookup finds drafts in it.
REPEATING = "one two three four " * 6


# ------------------------------------------------------------------------------------------------------------
# --model beside TSERVE_MODELS
# ------------------------------------------------------------------------------------------------------------
def test_tserve_models_serves_when_no_model_flag_is_given_and_a_flag_replaces_it(clean_env):  # noqa: F811
    """TSERVE_MODELS (a deployment's way, e.g. a container's environment) names the models when `tserve serve`
    has no --model; a --model flag wins over it entirely (the lists are not merged)."""
    clean_env.setenv("TSERVE_MODELS", "lm=/env/lm,mt=/env/mt")
    from_env = settings_from_args(build_parser().parse_args(["serve", "--port", "8123"]))
    assert from_env.model_specs() == {"lm": Path("/env/lm"), "mt": Path("/env/mt")}
    from_flag = settings_from_args(build_parser().parse_args(["serve", "--model", "other=/flag/other"]))
    assert from_flag.model_specs() == {"other": Path("/flag/other")}


def test_a_model_name_given_twice_is_refused_from_flags_and_from_the_environment(clean_env, served, capsys):  # noqa: F811
    """Two --model entries of one name would serve only the last one under it, silently: `tserve serve` refuses
    them (exit 2, nothing started), from flags and from TSERVE_MODELS alike."""
    assert main(["serve", "--model", "lm=/a/lm", "--model", "lm=/b/lm"]) == 2
    assert "given twice" in capsys.readouterr().err and not served
    clean_env.setenv("TSERVE_MODELS", "lm=/a/lm, lm=/b/lm")
    with pytest.raises(ValueError, match="given twice"):
        Settings().model_specs()
    assert main(["serve"]) == 2 and not served


# ------------------------------------------------------------------------------------------------------------
# One app: a language model and a translator with non-default limits, block size and prompt lookup
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """--max-n 3 above --max-prompts 2, --kv-block-size 8, prompt lookup with its shortest suffix set above its
    longest (the longest wins) and --speculative-max-rows 2."""
    root = tmp_path_factory.mktemp("settings-pairs")
    served_app = InProcessApp({"lm": TINY_LM, "mt": factories.tiny_mt_dir(root / "mt")}, gc_freeze=False,
                              file_dir=str(root / "files"), max_n=MAX_N, max_prompts=MAX_PROMPTS,
                              kv_block_size=BLOCK, speculative="ngram", prompt_lookup_min=2, prompt_lookup_max=1,
                              speculative_max_rows=2, cuda_graphs=False)
    yield served_app
    served_app.stop()


def drafted(app: InProcessApp) -> float:
    return app.app.state.metrics.registry.get_sample_value("tserve_speculative_draft_tokens_total",
                                                           {"model": "lm"}) or 0.0


def test_max_n_and_max_prompts_are_separate_limits_on_completions_and_chat(app):
    """--max-n bounds the choices per prompt and --max-prompts the prompts, each on its own: 2 prompts x 3
    choices (6 rows, more than either limit) is a valid completion, and a chat of 3 choices is valid under
    --max-prompts 2; one more choice, or one more prompt, is refused."""
    body = {"model": "lm", "prompt": ["Good morning", "Hello"], "max_tokens": 2, "temperature": 0, "n": MAX_N}
    choices = app.post("/v1/completions", body).json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(MAX_PROMPTS * MAX_N))
    app.post("/v1/completions", body | {"n": MAX_N + 1}, status=400)
    app.post("/v1/completions", body | {"prompt": ["a", "b", "c"], "n": 1}, status=400)
    chat = {"model": "lm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}
    assert len(app.post("/v1/chat/completions", chat | {"n": MAX_N}).json()["choices"]) == MAX_N
    app.post("/v1/chat/completions", chat | {"n": MAX_N + 1}, status=400)


def test_prompt_lookup_with_its_shortest_suffix_above_its_longest_still_drafts(app):
    """--prompt-lookup-min 2 --prompt-lookup-max 1: the server starts (the fixture) and looks up suffixes of one
    token (the shortest is capped at the longest), so a repeating prompt is drafted for: the two settings do not
    turn speculation off, nor stop the server from starting."""
    before = drafted(app)
    body = {"model": "lm", "prompt": REPEATING, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    app.post("/v1/completions", body)
    assert drafted(app) > before


def test_no_drafts_while_more_rows_run_than_speculative_max_rows(app):
    """--speculative-max-rows 2: one request of 2 prompts x 3 choices runs 6 rows at once, more than the drafts
    are made for, so none of its steps drafts (a step of many rows is compute-bound on the CPU), while one row
    of the same prompt is drafted for."""
    before = drafted(app)
    body = {"model": "lm", "prompt": [REPEATING, REPEATING], "max_tokens": 8, "temperature": 0, "n": MAX_N,
            "ignore_eos": True}
    assert len(app.post("/v1/completions", body).json()["choices"]) == MAX_PROMPTS * MAX_N
    assert drafted(app) == before
    app.post("/v1/completions", body | {"prompt": REPEATING, "n": 1})
    assert drafted(app) > before


def test_kv_block_size_reaches_the_language_model_and_the_translator(app):
    """--kv-block-size is the block size of every model with a KV cache: the language model's and the
    translator's (its decoder's) engines both report it, and both still answer."""
    metrics = app.app.state.metrics.registry
    for model in ("lm", "mt"):
        assert metrics.get_sample_value("tserve_kv_cache_block_size", {"model": model}) == BLOCK, model
    for model in ("lm", "mt"):
        assert app.registry.models[model].engine.runner.blocks.block_size == BLOCK, model
    out = app.post("/v1/translations", {"model": "mt", "input": "hello world", "max_tokens": 12}).json()
    assert isinstance(out["data"][0]["translation"], str)


# ------------------------------------------------------------------------------------------------------------
# --max-model-memory beside --quantize
# ------------------------------------------------------------------------------------------------------------
# Where the int8 weights are held depends on the CPU's kernels: `make test-avx2` runs it again on AVX2-only ones.
@pytest.mark.kernels
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_max_model_memory_counts_a_quantized_models_packed_weights(fmt):
    """--quantize keeps a model's weights where its kernels want them: int4's packed weights and scales as buffers,
    int8's (on PyTorch's engine) in an object of the engine's, neither parameter nor buffer. What a served quantized
    model holds counts them all (at least one byte per int8 weight), so a second model that fits beside its
    parameters alone, but not beside all it holds, is refused before its weights are read; with room for all of
    it, the second one loads."""
    probe = checkpoint.load(TINY_LM, device=torch.device("cpu"), dtype="float32", quantize=fmt,
                            pack_weights=True, fused_layers=True)
    held = held_bytes(probe.model)
    tensors = sum(t.numel() * t.element_size() for t in (*probe.model.parameters(), *probe.model.buffers()))
    linears = [m for m in probe.model.modules() if is_quantized_linear(m)]
    packed = [m for m in linears if is_int8_linear(m) and not m.exact]  # weights in the engine's own object
    assert linears and held >= tensors + sum(m.in_features * m.out_features for m in packed)
    del probe
    needed = checkpoint.weight_bytes(TINY_LM, torch.float32, fmt)  # the second one, as it will be held

    def registry(limit: int) -> ModelRegistry:
        reg = ModelRegistry(Settings(device="cpu", dtype="float32", quantize=fmt, max_model_memory=f"{limit}B",
                                     warmup=False, gc_freeze=False), Metrics())
        reg.load_model("lm", TINY_LM)
        assert reg.models["lm"].loaded.quantization == fmt
        return reg

    tight = registry(held + needed - 1)
    try:
        with pytest.raises(APIError, match="passes --max-model-memory"):
            tight.load_model("second", TINY_LM)
    finally:
        tight.stop()
    roomy = registry(held + needed)
    try:
        roomy.load_model("second", TINY_LM)
        assert roomy.states["second"].state == "READY"
    finally:
        roomy.stop()


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0"])
def test_a_model_that_fits_once_quantized_loads_under_max_model_memory_and_its_float_weights_do_not(fmt, monkeypatch):
    """--max-model-memory counts a model that --quantize will quantize as the bytes it will hold, from the
    checkpoint's headers: under a limit between its quantized and its float32 size it loads quantized, and the
    same limit refuses it unquantized, before its weights are read."""
    quantized, floats = (checkpoint.weight_bytes(TINY_LM, torch.float32, q) for q in (fmt, "none"))
    limit = (quantized + floats) // 2
    assert quantized < limit < floats

    def registry(quantize: str) -> ModelRegistry:
        return ModelRegistry(Settings(device="cpu", dtype="float32", quantize=quantize, max_model_memory=f"{limit}B",
                                      warmup=False, gc_freeze=False), Metrics())

    fits = registry(fmt)
    try:
        fits.load_model("lm", TINY_LM)
        assert fits.states["lm"].state == "READY" and fits.models["lm"].loaded.quantization == fmt
        assert held_bytes(fits.models["lm"].loaded.model) <= limit
    finally:
        fits.stop()
    refused = registry("none")
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(APIError, match="passes --max-model-memory"):
        refused.load_model("lm", TINY_LM)
