"""Sampling, penalties, stop strings and the one-request loops."""

from __future__ import annotations

import torch

from model.checkpoint import load
from model.generation import (
    SamplingParams,
    StopStrings,
    apply_penalties,
    filter_top_k_top_p,
    generate_tokens,
    sample,
    token_logprobs,
)


def test_top_k_and_top_p_filters_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.05]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5+0.3 >= 0.7
    assert torch.isfinite(out[2]).tolist() == [False, False, False, True]  # the top token always stays
    torch.testing.assert_close(out[0, :2], logits[0, :2])


def test_penalties_follow_openai_formula():
    logits = torch.zeros(2, 3)
    counts = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]])
    out = apply_penalties(logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.1, 1.0]))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.6, -0.8], [-2.0, 0.0, 0.0]]))


def test_seeded_sampling_is_independent_of_batch_neighbours():
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=0.8, seed=123)
    alone = [int(sample(logits, torch.tensor([0.8]), torch.tensor([0]), torch.tensor([1.0]), [g])[0])
             for g in [p.make_generator()] for _ in range(20)]
    g1, g2 = p.make_generator(), SamplingParams(temperature=1.0, seed=7).make_generator()
    batch = torch.cat([logits, torch.randn(1, 50)])
    mixed = [int(sample(batch, torch.tensor([0.8, 1.0]), torch.tensor([0, 5]), torch.tensor([1.0, 0.9]), [g1, g2])[0])
             for _ in range(20)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_greedy_rows_take_argmax_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tok = sample(logits, torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]), [None])
    assert tok.tolist() == [1]
    chosen, top_v, top_i = token_logprobs(logits, tok, 2)
    assert top_i.tolist() == [[1, 2]]
    torch.testing.assert_close(chosen, torch.log_softmax(logits, -1)[:, 1])


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


def test_generate_tokens_stops_and_respects_min_tokens(tiny_lm):
    lm = load(tiny_lm)
    prompt = lm.tokenizer.encode("Hello world")
    greedy = list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    assert len(greedy) == 12
    again = list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    assert greedy == again
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
    stopped = list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=8, temperature=0.0), eos))
    assert stopped == [eos]
    forced = list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3), eos))
    assert eos not in forced[:3] and len(forced) >= 4
    seeded = [list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True), eos))
              for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 8


def test_beam_searches_advanced_together_equal_each_alone():
    from model.beam_search import BeamSearch, BeamSettings

    V, width = 11, 20
    settings = [BeamSettings(num_beams=3, max_new_tokens=m, eos_token_id=2, length_penalty=lp, early_stopping=es,
                             banned_token_ids=[0], force_eos_at_max=True)
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
