"""A translator's decoding options where they meet, each compared with a reference: a greedy translation's score
under a length penalty that is not 1 (teacher forcing), a glossary search's stopping rule (plain beam search's
heuristic) under several length penalties, a glossary token the logits pipeline ruled out (Marian's forced last
eos), T5's relative position bias for rows that joined the running batch at different steps (teacher forcing;
each as it runs alone), word alignments of a batch of sentences of different lengths (each aligned alone), language
codes written with a lower-case script subtag or a region, and Marian's default length where a request gives none
(`generate`'s max_length)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import lexicon_sentences
from tests.helpers.one_request import job_tokens
from tests.model.test_seq2seq_runner import start
from tserve.model.alignment import align
from tserve.model.checkpoint import load
from tserve.model.decoding import Seq2SeqRunner, TranslationSequence, translation_job
from tserve.model.decoding.beam_search import BeamSettings
from tserve.model.decoding.constrained_beam import ConstrainedBeamSearch
from tserve.model.decoding.seq2seq_runner import run_jobs
from tserve.model.language_codes import model_code

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def teacher_forced_logprob(loaded, source: list[int], ids: list[int]) -> float:  # noqa: ANN001 - a LoadedModel
    """The model's summed log-probability of `ids` after `source` (one full forward pass)."""
    tgt = torch.tensor([[loaded.config.decoder_start_token_id, *ids[:-1]]])
    with torch.no_grad():
        logits = loaded.model(torch.tensor([source]), torch.tensor([len(source)]), tgt).float()
    return float(torch.log_softmax(logits, -1)[0].gather(1, torch.tensor(ids)[:, None]).sum())


# ------------------------------------------------------------------------------------------------------------
# Greedy decoding beside a length penalty
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length_penalty", [0.6, 1.4])
def test_a_greedy_translations_score_takes_the_checkpoints_length_penalty(tiny_mt, length_penalty):
    """A greedy translation is scored as beam search scores its hypotheses (log-probability over length **
    length_penalty), so that one request's greedy and beam scores compare. With the default penalty 1 the
    exponent is invisible; a checkpoint's 0.6 or 1.4 shows whether it is applied."""
    mt = load(tiny_mt, device="cpu")
    mt.generation.length_penalty = length_penalty
    sources = [mt.tokenizer.encode(t) for t in lexicon_sentences(3, seed=31, min_words=3, max_words=7)]
    runner = Seq2SeqRunner(mt, num_rows=3, cuda_graphs=False)
    seqs = run_jobs(mt, [translation_job(mt, s, num_beams=1, max_new_tokens=20) for s in sources], runner=runner)
    for source, seq in zip(sources, seqs, strict=True):
        ((ids, score),) = runner.hypotheses(seq)
        assert ids == seq.output_ids and len(ids) > 1
        expected = teacher_forced_logprob(mt, source, ids) / len(ids) ** length_penalty
        assert score == pytest.approx(expected, abs=1e-4)


# ------------------------------------------------------------------------------------------------------------
# A glossary's beam search: its stopping rule and the tokens the pipeline rules out
# ------------------------------------------------------------------------------------------------------------
EOS, START, V = 0, 1, 6


def step_log_probs(*rows: dict[int, float]) -> torch.Tensor:
    """Log-probs (beams, V): each row's given tokens, the rest of its mass spread over the other tokens."""
    out = torch.full((len(rows), V), -30.0)
    for b, given in enumerate(rows):
        rest = math.log(max(1e-9, 1 - sum(math.exp(v) for v in given.values())) / (V - len(given)))
        out[b] = rest
        for t, v in given.items():
            out[b, t] = v
    return out


@pytest.mark.parametrize("length_penalty", [1.0, 0.6, 1.5])
def test_a_glossary_search_goes_on_exactly_while_a_running_hypothesis_can_still_win(length_penalty):
    """A glossary's beam search stops as plain beam search does with early_stopping False (transformers'
    heuristic): once num_beams hypotheses have finished, it goes on only while its best running hypothesis, scored
    at the length it has now, beats the worst finished one. Judged at another length, under any length penalty
    it stops too early or too late, and its translations are not those the rule gives."""
    from tests.model.test_constrained_beam import START as T_START
    from tests.model.test_constrained_beam import bigram_table

    checked = 0
    for seed in range(8):
        table = bigram_table(seed)
        settings = BeamSettings(num_beams=3, max_new_tokens=14, eos_token_id=0, length_penalty=length_penalty)
        search = ConstrainedBeamSearch(settings, T_START, [[5]], ["5"])
        while not search.done:
            search.advance(table[search.last_tokens])
            live = [b for b in search.beams if b.score > -1e8]
            if len(search.finished) < settings.num_beams or not live or search.cur_len >= search.max_length:
                continue
            length = len(live[0].tokens)
            best_running = max(b.score for b in live) / length ** length_penalty
            worst_finished = search.finished[-1][0]
            assert search.done == (best_running <= worst_finished), (seed, length, best_running, worst_finished)
            checked += 1
    assert checked >= 3


def test_a_glossary_token_the_pipeline_ruled_out_never_finishes_a_hypothesis():
    """Marian forces eos at the last position (every other token -inf after the logits pipeline). A beam that has
    not placed its term then cannot finish: placing the term's token there would end a translation on a token
    the model may not write, without eos, scored -inf. Only the hypothesis that placed the term at step 1 comes
    back, however many alternatives are asked for."""
    settings = BeamSettings(num_beams=2, max_new_tokens=2, eos_token_id=EOS)
    search = ConstrainedBeamSearch(settings, START, [[5]], ["term"])
    search.advance(step_log_probs({3: -0.2, 5: -2.0}, {}))  # beam 1 starts dead: only beam 0 expands
    assert not search.done and sorted(len(b.met) for b in search.beams) == [0, 1]
    only_eos = torch.full((2, V), float("-inf"))
    only_eos[:, EOS] = 0.0
    search.advance(only_eos)
    hypotheses = search.hypotheses(2)
    assert [ids for ids, _ in hypotheses] == [[5, EOS]]
    assert all(math.isfinite(score) for _, score in hypotheses)


# ------------------------------------------------------------------------------------------------------------
# T5's relative position bias for requests at different steps
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return load(factories.hf_t5_dir(tmp_path_factory.mktemp("hf-t5")), device="cpu")


def test_t5_rows_at_different_positions_each_read_their_own_position_bias(t5):
    """A T5 decoder step holds rows at different positions when requests join a running batch mid-way: each row's
    relative position bias must be its own position's (in a batch started together every row shares one, so the
    one-request tests cannot tell). Each row's logits at every step equal teacher forcing's for its own tokens, and
    every request ends as it ends alone."""
    tok, start_id = t5.tokenizer, t5.config.decoder_start_token_id
    texts = [("der schnelle braune Fuchs", "<2en>"), ("the king is nice today", "<2de>"),
             ("Guten Morgen wo ist der Bahnhof", "<2en>")]
    jobs = [translation_job(t5, tok.encode_with_language(t, tag), num_beams=1, max_new_tokens=16) for t, tag in texts]
    alone = [job_tokens(t5, job) for job in jobs]
    runner = Seq2SeqRunner(t5, num_rows=3, cuda_graphs=False, block_size=4)
    seqs = [TranslationSequence(job) for job in jobs]
    running: list[TranslationSequence] = []
    mixed = 0
    for k in range(60):
        if k % 2 == 0 and k // 2 < len(seqs):  # each joins two steps after the one before
            start(runner, [seqs[k // 2]])
            running.append(seqs[k // 2])
        if not running:
            break
        positions = [s.step_position for s in running]
        mixed += len(set(positions)) > 1
        logits, spans = runner.decode(running)
        for s, position, (row, _) in zip(running, positions, spans, strict=True):
            src = torch.tensor([s.job.source_ids])
            tgt = torch.tensor([[start_id, *s.generated[:position]]])
            with torch.no_grad():
                forced = t5.model(src, torch.tensor([src.size(1)]), tgt).float()[0, position]
            torch.testing.assert_close(logits[row], forced, atol=1e-4, rtol=1e-4)
        for s, token in zip(list(running), runner.advance(running, logits, spans), strict=True):
            if runner.append(s, token) is not None:
                running.remove(s)
                runner.release(s)
    assert not running and mixed >= 3
    assert [s.output_ids for s in seqs] == alone


# ------------------------------------------------------------------------------------------------------------
# Word alignments of a batch of sentences of different lengths
# ------------------------------------------------------------------------------------------------------------
def test_word_alignments_of_a_batch_equal_each_sentence_aligned_alone(tmp_path_factory):
    """`align` runs pairs in padded batches: the shorter sources' padding must stay out of the encoder and the
    cross-attention, so that each pair aligns as it does alone (its teacher-forced attention maps too)."""
    from tserve.model.alignment import cross_attention

    mt = load(factories.aligned_mt_dir(tmp_path_factory.mktemp("aligned") / "mt"), device="cpu")
    tok = mt.tokenizer
    sources = [tok.encode(t) for t in ("the house", *lexicon_sentences(3, seed=7, min_words=5, max_words=9))]
    assert len({len(s) for s in sources}) > 2
    pairs = [(s, run_jobs(mt, [translation_job(mt, s, num_beams=1, max_new_tokens=20)])[0].output_ids)
             for s in sources]
    together = align(mt, pairs)
    assert together == [align(mt, [p])[0] for p in pairs]
    for both, (one,) in zip(cross_attention(mt, pairs), (cross_attention(mt, [p]) for p in pairs), strict=True):
        torch.testing.assert_close(both, one, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------------
# Language codes as users write them
# ------------------------------------------------------------------------------------------------------------
NLLB = ["eng_Latn", "deu_Latn", "zho_Hans", "zho_Hant", "srp_Cyrl", "srp_Latn", "por_Latn"]
MADLAD = ["<2en>", "<2de>", "<2zh>", "<2zh_Hant>", "<2pt>", "<2sr_Latn>", "<2sr>"]


@pytest.mark.parametrize(("asked", "nllb", "madlad"), [
    ("zh-hant", "zho_Hant", "<2zh_Hant>"), ("ZH-HANT-tw", "zho_Hant", "<2zh_Hant>"), ("zh-Hant", "zho_Hant", "<2zh_Hant>"),
    ("zh_hans", "zho_Hans", "<2zh>"), ("sr-latn", "srp_Latn", "<2sr_Latn>"), ("sr-Cyrl", "srp_Cyrl", "<2sr>"),
    ("pt-BR", "por_Latn", "<2pt>"), ("en-US", "eng_Latn", "<2en>"), ("eng_Latn", "eng_Latn", "<2en>"),
])
def test_a_script_subtag_picks_the_script_in_any_case(asked, nllb, madlad):
    """BCP-47 subtags are case-insensitive: `zh-hant` and `sr-latn` are the scripts `zh-Hant` and `sr-Latn`
    name, for NLLB's codes and MADLAD-400's tags alike; a region (`pt-BR`, `en-US`) leaves the language's code."""
    assert model_code(asked, NLLB) == nllb
    assert model_code(asked, MADLAD) == madlad


@pytest.mark.parametrize(("asked", "short"), [("zh-Hant", "zt"), ("zh-hant", "zt"), ("zh-TW", "zt"), ("zh-HK", "zt"),
                                              ("zt", "zt"), ("zho_Hant", "zt"), ("zh", "zh"), ("zh-CN", "zh"),
                                              ("zh-Hans", "zh"), ("zh-SG", "zh")])
def test_traditional_chinese_is_found_among_the_short_codes_routes_are_listed_by(asked, short):
    """The routes between served translators are listed by LibreTranslate's short codes, where Traditional Chinese
    is `zt`: `zh-Hant` (and a region written in it, `zh-TW`, `zh-HK`) is that one, not Simplified `zh`; the
    model's own codes take a region the same way."""
    assert model_code(asked, ["en", "zh", "zt"]) == short
    assert model_code(asked, NLLB) == ("zho_Hant" if short == "zt" else "zho_Hans")


# ------------------------------------------------------------------------------------------------------------
# The checkpoint's default length, where a request gives none
# ------------------------------------------------------------------------------------------------------------
def test_marians_default_length_is_generates_max_length_less_the_start_token(hf_marian, tmp_path):
    """Without max_tokens a translation runs to `generate`'s limit: generation_config's max_length counts the
    decoder start token, so at most max_length - 1 tokens come (63 here); a max_new_tokens there wins."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    config = transformers.GenerationConfig.from_pretrained(hf_marian)
    mt = load(hf_marian)
    assert mt.generation.max_new_tokens == config.max_length - 1 == 63
    assert translation_job(mt, [5, 6, 0]).max_new_tokens == 63
    d = shutil.copytree(hf_marian, tmp_path / "marian")
    raw = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(raw | {"max_new_tokens": 20}))
    assert translation_job(load(d), [5, 6, 0]).max_new_tokens == 20
