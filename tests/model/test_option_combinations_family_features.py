"""Serving features whose own tests run on one model family, on the trained Llama-family fixtures whose peculiarity
their code path must carry: the speculative step's forward (the next token and its draft scored in one pass) on
every family, Granite's logits scaling and Gemma 2's soft cap included, and on the sliding families (Gemma 3, Phi-3)
while the context is still inside the window; the prompt scoring of `echo` with `logprobs` on families whose output
layer is scaled or capped; a draft model of a family with q/k norms, whose rows are caught up in one ragged prefill
from different starts. References: the model's own uncached forward (held to `transformers` by
tests/model/test_llama_family.py), or `transformers` on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.llama_family import FAMILIES
from tserve.model import checkpoint
from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, TextSequence, generate
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels (the served layouts' decode kernels): `make test-avx2` runs it again.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-features")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(directories):
    return {f: checkpoint.load(d, device="cpu") for f, d in directories.items()}


def _ids(model, n: int) -> list[int]:  # noqa: ANN001
    """The first `n` tokens of the fixtures' training text (so that the models answer with confidence)."""
    ids = model.tokenizer.encode(CYCLE_TEXT * 3)
    assert len(ids) >= n
    return ids[:n]


# --- the speculative step's forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("length", ["inside-the-window", "past-the-window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_speculative_steps_scores_equal_the_whole_forward_on_every_family(loaded, family, length):
    """A speculative step feeds a row's next token and its draft (4 tokens) over the cached prompt, and judges the
    draft by those positions' logits, which are also the logprobs it reports and the distribution sampled rows draw
    from. They must be the uncached forward's at the same positions: with Granite's logits divided by its
    `logits_scaling` and Gemma 2's soft-capped (the greedy token would not show either), and on the sliding layers
    of Gemma 3 (window 16) and Phi-3 (window 48) both while the whole context fits in the window (the draft
    positions still may not see the ones after them) and past it."""
    lm = loaded[family]
    model = lm.model
    window = lm.config.sliding_window if lm.config.sliding_layers else 16
    n = 10 if length == "inside-the-window" else window + 12
    ids = _ids(lm, n)
    ahead = 4
    cache = model.new_cache(1, 128, num_blocks=40, block_size=4)
    cache.set_table(0, list(range(39, 7, -1)))
    with torch.no_grad():
        model.prefill(torch.tensor([ids[:-ahead]]), torch.tensor([n - ahead]), cache, torch.tensor([0]))
        positions = torch.arange(n - ahead, n)[None]
        got = model.decode_tokens(torch.tensor([ids[-ahead:]]), positions, cache, torch.tensor([0]), kv_len=n)[0]
        want = model(torch.tensor([ids]))[0, -ahead:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(want, -1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["granite", "gemma2", "gemma3", "phi3"])
def test_sampled_rows_with_prompt_lookup_drafts_write_what_they_write_without(loaded, family):
    """Seeded sampling with prompt-lookup speculation draws each kept position from the speculative step's
    distribution: on families whose logits are scaled (Granite), capped (Gemma 2) or read through sliding layers on a
    short context (Gemma 3, Phi-3) the tokens equal those of the same seeds without speculation."""
    lm = loaded[family]
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[i:i + 5])) for i in (0, 3, 7)]
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    plain = generate(lm, prompts, params)
    runner = DecoderRunner(lm, num_slots=3, cuda_graphs=False, speculation=Speculation(num_tokens=4))
    fast = generate(lm, prompts, params, runner=runner)
    assert sum(s.drafted for s in fast) > 0
    assert [s.generated for s in fast] == [s.generated for s in plain]


# --- echo with logprobs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["granite", "gemma2", "qwen2"])
def test_prompt_scoring_of_echo_equals_transformers_logprobs(directories, loaded, family):
    """`echo` with `logprobs` scores every prompt token given the ones before it in one uncached forward
    (`score_prompt`): each logprob and the top ones are `transformers`' log-softmax, which carries Granite's logits
    scaling and Gemma 2's final soft cap (Qwen2 neither: the plain case)."""
    lm = loaded[family]
    engine = GenerationEngine(family, lm, max_slots=2, max_queue=4, max_model_len=None, timeout_s=60.0,
                              metrics=Metrics())
    ids = _ids(lm, 12)
    scored = engine.score_prompt(ids, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directories[family], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert scored[0] is None and len(scored) == len(ids)
    got = torch.tensor([s.logprob for s in scored[1:]])
    torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)
    for s, row in zip(scored[1:], ref, strict=True):
        assert sorted(s.top.values(), reverse=True) == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


# --- a draft model ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_draft_models_rows_caught_up_from_different_starts_read_their_whole_context(loaded, family, monkeypatch):
    """The draft model (here the target itself: Qwen3's q/k norms and head size of its own, Gemma 3's sliding first
    layer and (1 + w) norms) feeds each row what its cache lacks in one ragged prefill: a row new to it from position
    0, beside a row it drafted for before, from its cached positions on. Each row's next-token logits there are those
    of the uncached forward over all its tokens, and its draft is the model's own greedy continuation."""
    lm = loaded[family]
    runner = DecoderRunner(lm, num_slots=3, cuda_graphs=False, speculation=Speculation(num_tokens=4), draft=lm)
    drafter = runner.drafter
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def own(tokens: list[int], k: int) -> list[int]:
        return generate(lm, [tokens], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))[0].generated

    def seq(ids: list[int], slot: int) -> TextSequence:
        s = TextSequence(ids, greedy)
        s.slot = slot
        return s

    old = seq(lm.tokenizer.encode("Guten Morgen, wo ist der Bahnhof? The cat sat on the mat and the dog"), 0)
    (first,) = drafter.draft([old], [4])
    assert first == own(old.token_ids(), 4)
    drafter.kept(old, 4)  # all kept: its cache holds all but the last draft token
    old.generated += first
    old.generated += own(old.token_ids(), 5)  # then steps without drafts: six tokens for the draft model to catch up
    new = seq(lm.tokenizer.encode("Where is the station?")[:3], 1)  # the shorter feed: first in the prefill
    seen = {}
    prefill = lm.model.prefill

    def recorded(tokens, lengths, cache, slots, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        logits = prefill(tokens, lengths, cache, slots, *args, **kw)
        seen.update({int(slot): row for slot, row in zip(slots, logits, strict=True)})
        return logits

    monkeypatch.setattr(lm.model, "prefill", recorded)
    drafts = drafter.draft([old, new], [4, 4])
    monkeypatch.undo()
    assert sorted(seen) == [0, 1]
    with torch.no_grad():
        for s in (old, new):
            want = lm.model(torch.tensor([s.token_ids()]))[0, -1]
            torch.testing.assert_close(seen[s.slot], want, atol=1e-4, rtol=1e-4)
    assert drafts == [own(old.token_ids(), 4), own(new.token_ids(), 4)]
