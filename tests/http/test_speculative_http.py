"""`tserve serve --speculative ngram` and `tserve serve --draft-model PATH`: OpenAI completions, streamed and not,
answer what decoding without speculation gives (tokens, text and logprobs), and /metrics counts the drafts and
the kept tokens; a draft model of another vocabulary stops the server at start with the reason."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.one_request import lm_tokens
from tests.helpers.server import ServerProcess, streamed_completion_text
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module", params=["ngram", "draft-model"])
def server(request, lm_dir, tmp_path_factory):
    """Prompt-lookup drafts, or a draft model with the model's own weights (every greedy draft kept)."""
    if request.param == "ngram":
        drafts = ["--speculative", "ngram"]
    else:
        drafts = ["--draft-model", str(factories.tiny_lm_dir(tmp_path_factory.mktemp("draft")))]
    srv = ServerProcess(["--model", f"lm={lm_dir}", *drafts, "--num-speculative-tokens", "3"],
                        tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    srv.drafts = request.param
    yield srv
    srv.stop()


def prompts() -> list[str]:
    """Cycle pieces that repeat their own beginning: the model's continuation is in the context."""
    words = CYCLE_TEXT.split()
    return [" ".join(words[a:a + 16] + words[a:a + 10]) for a in (8, 16, 36)]


def test_completions_answer_what_decoding_without_speculation_gives(server, lm_dir):
    lm = checkpoint.load(lm_dir)
    bodies = [{"model": "lm", "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 1} for p in prompts()]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda b: httpx.post(server.url + "/v1/completions", json=b, timeout=60), bodies))
    for body, resp in zip(bodies, answers, strict=True):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        ids = lm.tokenizer.encode(body["prompt"])
        expected = lm_tokens(lm, ids, SamplingParams(max_tokens=12, temperature=0.0), with_eos=False)
        assert choice["text"] == lm.tokenizer.decode(expected)
        assert choice["logprobs"]["tokens"] == lm.tokenizer.tokens(expected)
    drafted = server.metric("tserve_speculative_draft_tokens_total", "lm")
    kept = server.metric("tserve_speculative_accepted_tokens_total", "lm")
    assert drafted > 0 and 0 < server.metric("tserve_speculative_acceptance_rate", "lm") <= 1
    assert kept == drafted if server.drafts == "draft-model" else kept > 0


def test_a_streamed_completion_is_the_same_text(server):
    body = {"model": "lm", "prompt": prompts()[0], "max_tokens": 12, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert streamed_completion_text(server.url, body) == whole and whole


def test_a_draft_model_of_another_vocabulary_stops_the_server_with_the_reason(lm_dir, tmp_path):
    other = factories.hf_gpt2_dir(tmp_path / "gpt2")
    srv = ServerProcess(["--model", f"lm={lm_dir}", "--draft-model", str(other)], tmp_path / "server.log")
    try:
        with pytest.raises(RuntimeError, match="another vocabulary"):
            srv.wait_ready()
    finally:
        srv.stop()
