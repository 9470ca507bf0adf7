"""The logits pipeline, the sampler, stop strings, beam search state and `generate`, in-process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers.one_request import lm_tokens
from tserve.model.checkpoint import load
from tserve.model.decoding import (
    BeamSearch,
    BeamSettings,
    LogitsPipeline,
    SamplingParams,
    StopStrings,
    generate,
    parse_logit_bias,
    sample,
    token_logprobs,
    translate,
)
from tserve.model.decoding.logits import filter_top_k_top_p
from tserve.model.kernels import cpu as cpu_kernels

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@dataclass
class Row:
    """A row as the pipeline sees it."""

    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    num_generated: int = 0
    counts: list[float] | None = None

    def token_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.counts or [0.0] * vocab_size, device=device)


def test_top_k_and_top_p_filters_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.05]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5+0.3 >= 0.7
    assert torch.isfinite(out[2]).tolist() == [False, False, False, True]  # the top token always stays
    torch.testing.assert_close(out[0, :2], logits[0, :2])


def test_the_pipeline_filters_only_the_rows_that_ask():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = [Row(SamplingParams(temperature=1.0, top_k=2)), Row(), Row(SamplingParams(temperature=1.0, top_p=0.7))]
    out = LogitsPipeline(None)(logits, rows)
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True] * 4, [True, True, False, False]]
    torch.testing.assert_close(out[1], logits[1])


def test_penalties_follow_openai_formula():
    rows = [Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.1), counts=[0.0, 1.0, 3.0]),
            Row(SamplingParams(frequency_penalty=1.0), counts=[2.0, 0.0, 0.0]), Row(counts=[5.0, 5.0, 5.0])]
    out = LogitsPipeline(None).constrain(torch.zeros(3, 3), rows)
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.6, -0.8], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_logit_bias_forces_and_bans_in_its_own_row_only():
    logits = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 3))
    rows = [Row(SamplingParams(temperature=0.0, logit_bias={3: 100.0})), Row(),
            Row(SamplingParams(temperature=0.0, logit_bias={0: -100.0, 2: 1.5}))]
    out = LogitsPipeline(None).constrain(logits, rows)
    assert out.argmax(-1).tolist() == [3, 0, 2]
    torch.testing.assert_close(out[1], logits[1])
    torch.testing.assert_close(out[2] - logits[2], torch.tensor([-100.0, 0.0, 1.5, 0.0]))


def test_eos_ban_banned_ids_and_forced_eos_follow_each_rows_state():
    eos, pad = 3, 0
    pipe = LogitsPipeline(eos, banned_token_ids=[pad], force_eos_at_max=True)
    rows = [Row(SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2), num_generated=1),  # too early for eos
            Row(SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2), num_generated=2),  # eos allowed
            Row(SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), num_generated=2),
            Row(SamplingParams(temperature=0.0, max_tokens=5), num_generated=4)]  # last position: eos only
    out = pipe.constrain(torch.zeros(4, 5), rows)
    inf = float("-inf")
    assert out.tolist() == [[inf, 0, 0, inf, 0], [inf, 0, 0, 0, 0], [inf, 0, 0, inf, 0], [inf, inf, inf, 0, inf]]


def test_rows_whose_constraints_only_rule_ids_out_take_the_argmax_of_the_rest():
    """A greedy step whose rows' constraints only ban ids (eos under min_tokens or ignore_eos, the checkpoint's banned
    ids) takes each row's argmax over the ids left (`exclusions`, the runner's greedy path), with the ids written
    -inf as the pipeline writes them; any other constraint on any row (bias, penalties, forced eos) sends the step
    through the pipeline."""
    eos, pad = 3, 0
    pipe = LogitsPipeline(eos, banned_token_ids=[pad], force_eos_at_max=True)
    rows = [Row(SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2), num_generated=1),  # too early for eos
            Row(SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2), num_generated=2),  # eos allowed
            Row(SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), num_generated=2)]
    assert pipe.exclusions(rows) == [[pad, eos], [pad], [pad, eos]]
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    logits[:, eos] += 10.0  # eos first everywhere, pad second
    logits[:, pad] += 5.0
    expected = pipe.constrain(logits, rows)
    got = logits.clone()
    assert cpu_kernels.argmax(got, pipe.exclusions(rows)).tolist() == expected.argmax(-1).tolist() == [
        int(expected[0].argmax()), eos, int(expected[2].argmax())]
    assert torch.equal(got, expected)
    for other in (Row(SamplingParams(temperature=0.0, logit_bias={1: 5.0})), Row(counts=[1.0] * 7,
                  params=SamplingParams(temperature=0.0, presence_penalty=1.0)),
                  Row(SamplingParams(temperature=0.0, max_tokens=5), num_generated=4)):
        assert pipe.exclusions([*rows, other]) is None


def test_a_forced_first_token_is_the_only_choice_at_a_rows_first_step():
    """A multilingual translator's target language (`forced_bos_token_id`): at a row's first step only its forced
    token may come, scored 0 as transformers scores it; later steps, and rows without one, are left alone."""

    @dataclass
    class Forced(Row):
        forced_first_token: int | None = None

    logits = torch.randn(4, 6)
    rows = [Forced(forced_first_token=4), Forced(forced_first_token=4, num_generated=1), Forced(),
            Forced(forced_first_token=1)]
    out = LogitsPipeline(None).constrain(logits, rows)
    inf = float("-inf")
    assert out[0].tolist() == [inf, inf, inf, inf, 0.0, inf] and out[3].tolist() == [inf, 0.0, inf, inf, inf, inf]
    torch.testing.assert_close(out[1:3], logits[1:3])


def test_processors_that_no_row_uses_cost_nothing():
    """Greedy rows without penalties, bias or filters: the scores go through untouched, not even copied."""
    logits = torch.randn(3, 7)
    pipe = LogitsPipeline(6, force_eos_at_max=True)
    rows = [Row(SamplingParams(temperature=0.0, max_tokens=9), num_generated=i) for i in range(3)]
    assert pipe(logits, rows) is logits
    assert pipe.shape(logits, [Row(SamplingParams(temperature=1.0))] * 3) is logits


def test_seeded_sampling_is_independent_of_batch_neighbours():
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=0.8, seed=123)
    pipe = LogitsPipeline(None)
    g = p.make_generator()
    alone = [int(sample(pipe(logits, [Row(p)]), [p], [g])[0]) for _ in range(20)]
    other = SamplingParams(temperature=1.0, top_k=5, seed=7)
    g1, g2 = p.make_generator(), other.make_generator()
    batch = torch.cat([logits, torch.randn(1, 50)])
    mixed = [int(sample(pipe(batch, [Row(p), Row(other)]), [p, other], [g1, g2])[0]) for _ in range(20)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_sampling_draws_tokens_with_their_probabilities():
    """4000 draws (200 rows of 20 steps, batched) of a 4-token distribution: each frequency within 0.03 of
    its probability (about 4 standard deviations)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(200)]
    gens = [p.make_generator() for p in params]
    logits = probs.log().expand(200, 4)
    draws = torch.cat([sample(logits, params, gens) for _ in range(20)])
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert (freq - probs).abs().max() < 0.03, freq


def test_greedy_rows_take_argmax_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1, seed=0)]
    tok = sample(LogitsPipeline(None)(logits, [Row(p) for p in params]), params, [None, params[1].make_generator()])
    assert tok.tolist() == [1, 0]
    chosen, top_v, top_i = token_logprobs(logits, tok, 2)
    assert top_i.tolist() == [[1, 2], [0, 2]]
    torch.testing.assert_close(chosen, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_logit_bias_is_validated_against_the_vocabulary():
    assert parse_logit_bias({"5": 100, "0": -100.0}, 10) == {5: 100.0, 0: -100.0}
    assert parse_logit_bias(None, 10) == {}
    for bad, words in (({"10": 1}, "outside"), ({"-1": 1}, "outside"), ({"x": 1}, "not a token id"),
                       ({"3": 100.5}, "-100 to 100"), ({str(i): 1 for i in range(301)}, "at most 300")):
        with pytest.raises(ValueError, match=words):
            parse_logit_bias(bad, 10 if len(bad) == 1 else 1000)


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["###", "END"])
    assert s.feed("Hello #") == ("Hello ", False)
    assert s.feed("# wor") == ("## wor", False)
    assert s.feed("ld EN") == ("ld ", False)
    assert s.feed("D more") == ("", True)
    assert s.flush() == ""
    s2 = StopStrings(["xyz"])
    assert s2.feed("abc xy") == ("abc ", False)
    assert s2.flush() == "xy"
    s3 = StopStrings(["END"])  # a match inside one delta: what precedes it is emitted, the rest is cut
    assert s3.feed("say END now") == ("say ", True)
    assert s3.feed("more") == ("", True) and s3.flush() == ""


def test_stop_strings_close_checks_the_detokenizers_last_text():
    s = StopStrings(["END"])
    assert s.feed("the EN") == ("the ", False)
    assert s.close("D") == ("", True)  # completed by the text the detokenizer held back to the end
    s = StopStrings(["END"])
    assert s.feed("the EN") == ("the ", False)
    assert s.close("") == ("EN", False)


def test_stop_strings_cut_a_stream_however_it_is_chunked():
    """The reference: the text up to the first occurrence of any stop string (well inside the text, so
    there is something to emit and something to cut), whatever the sizes of the deltas."""
    text = "Guten Morgen. Wo ist der Bahnhof? ## Ich weiß ### es nicht. END ###"
    stops = ["END", "###", "Bahnhof!"]  # "Bahnhof!" and "##" only start stop strings: held back, then let go
    expected = text[: text.index("###")]
    assert len(expected) > 30 and expected.endswith("## Ich weiß ")
    for size in range(1, len(text) + 1):
        s = StopStrings(stops)
        out, hit = [], False
        for i in range(0, len(text), size):
            emitted, hit = s.feed(text[i : i + size])
            out.append(emitted)
            if hit:
                break
        assert hit and "".join(out) + s.flush() == expected, size
        s = StopStrings(stops)  # no stop string in the text: everything comes out
        unstopped = text.replace("###", "#").replace("END", "E")
        out = [s.feed(unstopped[i : i + size]) for i in range(0, len(unstopped), size)]
        assert not any(hit for _, hit in out) and "".join(e for e, _ in out) + s.flush() == unstopped, size


def test_generate_stops_and_respects_min_tokens(tiny_lm):
    lm = load(tiny_lm)
    prompt = lm.tokenizer.encode("Hello world")
    greedy = lm_tokens(lm, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(greedy) == 12
    assert greedy == generate(lm, [prompt] * 2, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[1].generated
    # Make eos the greedy choice with a large bias on its logit: generation stops at once, unless
    # min_tokens / ignore_eos forbid it.
    eos = lm.tokenizer.eos_id
    head = lm.model.lm_head

    class EosHead(torch.nn.Module):
        weight = head.weight

        def forward(self, x):
            out = head(x)
            out[..., eos] += 100.0
            return out

    lm.model.lm_head = EosHead()
    stopped = lm_tokens(lm, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert stopped == [eos]
    forced = lm_tokens(lm, prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3))
    assert eos not in forced[:3] and len(forced) >= 4
    seeded = [lm_tokens(lm, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
              for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 8


def test_beam_searches_advanced_together_equal_each_alone():
    V, width = 11, 20
    settings = [BeamSettings(num_beams=3, max_new_tokens=m, eos_token_id=2, length_penalty=lp, early_stopping=es)
                for m, lp, es in ((6, 1.0, False), (12, 1.0, False), (3, 1.0, False), (9, 1.0, False))]
    g = torch.Generator().manual_seed(0)
    steps = [torch.log_softmax(torch.randn(len(settings), 3, V, generator=g) * 3, -1) for _ in range(14)]
    alone = []
    for i, st in enumerate(settings):
        search = BeamSearch(st, 1, width=width)
        k = 0
        while not search.done:
            search.advance(steps[k][i])
            k += 1
        alone.append((search.best(), search.best_score))
    together = [BeamSearch(st, 1, width=width) for st in settings]
    assert len({s.group_key() for s in together}) == 1
    k = 0
    while any(not s.done for s in together):
        live = [i for i, s in enumerate(together) if not s.done]
        parents = BeamSearch.advance_many([together[i] for i in live], steps[k][live].reshape(-1, V))
        assert parents.shape == (len(live), 3)
        k += 1
    assert [(s.best(), s.best_score) for s in together] == alone


def test_the_library_loads_and_decodes_without_the_server(tiny_lm, tiny_mt):
    """`from tserve import model; model.load(...)` and `model.decoding` as docs/MODELS.md shows them."""
    from tserve import model

    lm = model.load(tiny_lm, device="cpu", dtype="float32")
    assert lm.dtype == torch.float32 and lm.task == "text-generation"
    prompts = [lm.tokenizer.encode(t) for t in ("Hello world", "Good morning")]
    outs = generate(lm, prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * 2
    assert [o.generated for o in outs] == [lm_tokens(lm, p, SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True)) for p in prompts]
    mt = model.load(tiny_mt)
    (t,) = translate(mt, [mt.tokenizer.encode("Good morning.")], num_beams=2, max_new_tokens=6)
    assert t.job.num_beams == 2 and 1 <= len(t.output_ids) <= 6 and t.finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="exceeds this model's context"):
        generate(lm, prompts[:1], SamplingParams(max_tokens=lm.config.max_seq_len))


def test_a_rows_logits_barely_depend_on_its_batch(tiny_lm):
    """What docs/API.md promises about batch invariance in float32 on a CPU: a request's logits alone and among
    7 others (other prompts and lengths: padded prefill, decode over a longer attended length) differ by at
    most 1e-4 at every step; tokens are then the same unless two candidates are closer than that."""
    from tests.helpers.fixture_training import cycle_prompts
    from tserve.model.decoding import DecoderRunner, TextSequence

    lm = load(tiny_lm)
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(8, seed=2)]
    forced = lm.tokenizer.encode(" the house is small", add_special_tokens=False)

    def logits_of_first(batch: list[list[int]]) -> torch.Tensor:
        runner = DecoderRunner(lm, num_slots=8, cuda_graphs=False)
        seqs = [TextSequence(p, SamplingParams(max_tokens=16, temperature=0.0)) for p in batch]
        for s in seqs:
            assert runner.admit(s)
        steps = [runner.prefill(seqs)[0]]
        for token in forced:  # the same continuation for every row, fed step by step
            for s in seqs:
                s.generated.append(token)
                s.next_token = token
                assert runner.grow(s)
            steps.append(runner.decode(seqs)[0])
        return torch.stack(steps)

    alone, among = logits_of_first(prompts[:1]), logits_of_first(prompts)
    assert alone.shape == (len(forced) + 1, lm.config.vocab_size)
    assert (alone - among).abs().max() <= 1e-4
    assert not torch.equal(logits_of_first(prompts[1:2]), alone)  # the prompt matters


def test_the_runner_keeps_penalty_counts_and_checks_prompts(tiny_lm):
    """The token counts the penalties read are the counts of the generated tokens (kept up to date step by
    step); a one-token prompt runs, an empty one is refused."""
    from tserve.model.decoding import DecoderRunner

    lm = load(tiny_lm)
    params = SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5, ignore_eos=True)
    (seq,) = generate(lm, [lm.tokenizer.encode("Hello world")], params)
    expected = torch.bincount(torch.tensor(seq.generated), minlength=lm.config.vocab_size).float()
    assert len(set(seq.generated)) < len(seq.generated)  # some token came twice: counts above 1 matter
    assert torch.equal(seq.counts, expected)
    runner = DecoderRunner(lm, num_slots=1, cuda_graphs=False)
    runner.check(1, 4)
    assert len(generate(lm, [[lm.tokenizer.encode("Hello")[0]]], SamplingParams(max_tokens=3, temperature=0.0,
                                                                             ignore_eos=True))[0].generated) == 3
    with pytest.raises(ValueError, match="empty"):
        runner.check(0, 4)


def test_beam_settings_come_from_the_checkpoint(tiny_mt):
    from tserve.model.decoding import Seq2SeqRunner, translation_job

    mt = load(tiny_mt)
    mt.generation.length_penalty, mt.generation.early_stopping = 0.7, "never"
    settings = Seq2SeqRunner(mt, num_rows=2, cuda_graphs=False).beam_settings(translation_job(mt, [5, 6], 2, 9))
    assert (settings.num_beams, settings.max_new_tokens, settings.eos_token_id) == (2, 9, mt.config.eos_token_id)
    assert (settings.length_penalty, settings.early_stopping) == (0.7, "never")


def test_a_finished_hypothesis_is_scored_with_the_length_penalty():
    """transformers' score: sum of log-probs / generated length ** length_penalty (here 3 tokens, 2.0)."""
    t0, t1, t2, eos = range(4)
    steps = torch.tensor([[0.1, 0.2, 0.6, 0.1], [0.1, 0.5, 0.1, 0.3], [0.2, 0.1, 0.1, 0.6]]).log()
    search = BeamSearch(BeamSettings(num_beams=1, max_new_tokens=10, eos_token_id=eos, length_penalty=2.0), t0)
    for step in steps:
        search.advance(step[None])
    assert search.done and search.best() == [t2, t1, eos]
    assert search.best_score == pytest.approx(float(torch.tensor([0.6, 0.5, 0.6]).log().sum()) / 3**2)


def test_a_checkpoint_without_generation_eos_ids_ends_on_the_tokenizers_eos(tiny_lm):
    """No eos ids in generation_config.json: the tokenizer's eos ends a sequence, not the model config's (which
    does without a tokenizer)."""
    from dataclasses import replace

    from tserve.model.decoding import DecoderRunner, TextSequence

    lm = load(tiny_lm)
    eos = lm.tokenizer.eos_id
    other = next(t for t in range(lm.config.vocab_size) if t != eos)
    lm = replace(lm, config=replace(lm.config, eos_token_id=other), generation=replace(lm.generation, eos_token_ids=[]))
    runner = DecoderRunner(lm, num_slots=1, cuda_graphs=False)
    assert runner.eos_ids == {eos}
    seq = TextSequence([other], SamplingParams(max_tokens=8, temperature=0.0))
    assert runner.append(seq, other) is None and runner.append(seq, eos) == "stop"
    assert seq.generated == [other]
    # Without a tokenizer either: the model config's eos.
    assert DecoderRunner(replace(lm, tokenizer=None), num_slots=1, cuda_graphs=False).eos_ids == {other}


def test_an_ending_candidate_outside_the_top_num_beams_does_not_finish():
    """Only candidates among the top num_beams enter the finished set (transformers' rule). Step 1: eos is the
    third of four candidates (0.4, 0.3, 0.15 for eos): it does not finish, though its score, log 0.15 = -1.90,
    would beat every hypothesis that does; step 2 ends both running beams at the length limit."""
    V, start, eos = 64, 0, 3
    first = torch.full((V,), 0.15 / 61)
    first[[1, 2, eos]] = torch.tensor([0.4, 0.3, 0.15])
    second = torch.full((2, V), 0.95 / 63)
    second[0, 5] = second[1, 6] = 0.05  # beam [1] continues best with 5, beam [2] with 6
    search = BeamSearch(BeamSettings(num_beams=2, max_new_tokens=2, eos_token_id=eos), start)
    search.advance(torch.stack([first, first]).log())
    assert not search.done
    search.advance(second.log())
    assert search.done
    expected = [([1, 5], (math.log(0.4) + math.log(0.05)) / 2), ([2, 6], (math.log(0.3) + math.log(0.05)) / 2)]
    got = search.hypotheses(2)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    assert [score for _, score in got] == pytest.approx([score for _, score in expected], rel=1e-5)


@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_never_stopping_early_scores_the_running_beam_at_the_longest_length(early_stopping):
    """One beam, length_penalty 1. Step 1 finishes [eos] (log 0.5 = -0.69) and keeps [t1] (log 0.4 = -0.92).
    early_stopping=False scores [t1] at its length, 1: it cannot win, the search ends. "never" scores it at the
    longest length, 4 (-0.23): the search goes on, and [t1, eos] ((log 0.4 + log 0.95) / 2 = -0.48) wins."""
    t0, t1, eos = 0, 1, 3
    steps = torch.tensor([[0.05, 0.4, 0.05, 0.5], [0.03, 0.015, 0.005, 0.95]]).log()
    search = BeamSearch(BeamSettings(num_beams=1, max_new_tokens=4, eos_token_id=eos, length_penalty=1.0,
                                     early_stopping=early_stopping), t0)
    taken = 0
    while not search.done:
        search.advance(steps[taken][None])
        taken += 1
    if early_stopping == "never":
        assert (taken, search.best()) == (2, [t1, eos])
        assert search.best_score == pytest.approx((math.log(0.4) + math.log(0.95)) / 2, rel=1e-5)
    else:
        assert (taken, search.best()) == (1, [eos])
        assert search.best_score == pytest.approx(math.log(0.5), rel=1e-5)


def test_a_prompt_counts_the_positions_it_found_in_the_prefix_cache(tiny_lm):
    """At its first admission a sequence records how much of its prompt came from blocks another one computed:
    here the two full blocks (of 4 positions) that a second prompt shares with a first one run before it."""
    from tserve.model.decoding import DecoderRunner

    lm = load(tiny_lm)
    first = lm.tokenizer.encode("Hello world, the house is small and the cat is black")
    assert len(first) >= 12
    second = [*first[:8], next(t for t in first if t != first[8]), *first[9:]]  # another third block
    runner = DecoderRunner(lm, num_slots=1, cuda_graphs=False, block_size=4)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (a,) = generate(lm, [first], params, runner=runner)
    (b,) = generate(lm, [second], params, runner=runner)
    assert (a.cached_tokens, b.cached_tokens) == (0, 8)


def test_a_search_where_fewer_hypotheses_than_beams_can_finish_returns_only_those():
    """Two beams, one position, only eos allowed there (Marian's forced eos at the length limit): one hypothesis
    finishes, and the other slot, never filled, is not returned as one."""
    start, eos = 0, 3
    only_eos = torch.full((2, 4), float("-inf"))
    only_eos[:, eos] = 0.0
    search = BeamSearch(BeamSettings(num_beams=2, max_new_tokens=1, eos_token_id=eos), start)
    search.advance(only_eos)
    assert search.done and search.hypotheses(2) == [([eos], 0.0)]
