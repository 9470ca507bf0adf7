"""`Seq2SeqRunner` driven step by step, in-process: what it claims for a request (rows, the blocks of a source and of
its first position, a cross slot shared by identical sources), what it gives up to make room, a request preempted
mid-way that replays its positions and ends as it ends alone, and a glossary job through the runner scored as
teacher forcing scores it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fixture_training import lexicon_sentences
from tests.helpers.one_request import job_tokens
from tserve.model.checkpoint import load
from tserve.model.decoding import Seq2SeqRunner, TranslationSequence, translation_job
from tserve.model.decoding.seq2seq_runner import run_jobs

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BLOCK = 4  # positions per block: a few words of source or output cross several


@pytest.fixture(scope="module")
def mt(tiny_mt):
    return load(tiny_mt, device="cpu")


def blocks_for(n: int) -> int:
    return -(-n // BLOCK)


def step(runner: Seq2SeqRunner, running: list[TranslationSequence]) -> None:
    """One decoder step of `running` (as `run_jobs` takes it); finished sequences leave the list and give back
    what they held."""
    logits, spans = runner.decode(running)
    for s, token in zip(list(running), runner.advance(running, logits, spans), strict=True):
        if runner.append(s, token) is not None:
            running.remove(s)
            runner.release(s)


def start(runner: Seq2SeqRunner, seqs: list[TranslationSequence]) -> None:
    for s in seqs:
        assert runner.reserve(s)
    runner.encode(seqs)
    for s in seqs:
        runner.begin(s)


def test_a_translation_sequence_counts_its_generated_tokens(mt):
    seq = TranslationSequence(translation_job(mt, [5, 6, 7], num_beams=1))
    assert seq.token_counts(10, torch.device("cpu")).tolist() == [0.0] * 10
    seq.generated = [3, 7, 3, 3, 9]
    expected = [0.0] * 10
    for t in seq.generated:
        expected[t] += 1
    assert seq.token_counts(10, torch.device("cpu")).tolist() == expected


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_request_preempted_mid_way_replays_its_positions_and_ends_as_alone(mt, num_beams):
    """Preempted after a few steps (its rows and blocks given back, its tokens or beams kept), admitted again, it
    recomputes its cache one position a step without choosing anything, then goes on: the same ids as alone."""
    source = mt.tokenizer.encode(lexicon_sentences(1, seed=11, min_words=6, max_words=6)[0])
    job = translation_job(mt, source, num_beams=num_beams, max_new_tokens=20)
    alone = job_tokens(mt, job)
    assert len(alone) > 6
    runner = Seq2SeqRunner(mt, num_rows=num_beams, cuda_graphs=False, block_size=BLOCK)
    seq = TranslationSequence(job)
    start(runner, [seq])
    running = [seq]
    for _ in range(5):
        step(runner, running)
    assert running and seq.next_position == 5
    runner.preempt(seq)
    assert seq.resume_at == 5 and runner.rows.num_used == 0 and runner.blocks_in_use == 0
    start(runner, [seq])
    assert seq.encoded  # the source's encoder output was kept: read again, not recomputed
    for replayed in range(1, 6):
        step(runner, running)
        assert seq.replayed == replayed and seq.next_position == 5  # nothing chosen while replaying
    for _ in range(40):
        if not running:
            break
        step(runner, running)
    assert not running and seq.output_ids == alone


def test_identical_sources_share_a_cross_slot_until_the_last_reader_leaves(mt):
    source = mt.tokenizer.encode(lexicon_sentences(1, seed=12, min_words=5, max_words=5)[0])
    runner = Seq2SeqRunner(mt, num_rows=2, cuda_graphs=False, block_size=BLOCK)
    first, second = (TranslationSequence(translation_job(mt, source, num_beams=1, max_new_tokens=12)) for _ in "ab")
    start(runner, [first])
    start(runner, [second])  # after the first's source is encoded: it reads that
    assert second.encoded and first.cross_slot == second.cross_slot and runner.cross_slots_held == 1
    runner.release(first)
    assert runner.cross_slots_held == 1 and runner.blocks_kept == 0  # still read by the second
    running = [second]
    for _ in range(20):
        if not running:
            break
        step(runner, running)
    assert not running and second.output_ids == job_tokens(mt, second.job)
    assert runner.cross_slots_held == 0 and runner.blocks_kept == blocks_for(len(source))  # now kept for reuse


def test_a_request_is_admitted_with_its_sources_blocks_giving_up_kept_outputs_to_the_last_block(mt):
    """A new source needs its own blocks besides its row's first: refused (nothing claimed) when the pool cannot
    give them even with the encoder outputs kept for reuse given up; admitted when that makes exactly enough."""
    encode = mt.tokenizer.encode
    short, long = encode("the house"), encode(lexicon_sentences(1, seed=13, min_words=9, max_words=9)[0])
    assert blocks_for(len(long)) > blocks_for(len(short)) + 1
    need_long = blocks_for(len(long)) + 1  # its source and its row's first position
    runner = Seq2SeqRunner(mt, num_rows=2, cuda_graphs=False, block_size=BLOCK, num_blocks=1 + need_long)
    kept = TranslationSequence(translation_job(mt, short, num_beams=1))
    start(runner, [kept])
    runner.release(kept)  # encoded: kept for an identical source
    assert runner.blocks_kept == blocks_for(len(short)) and runner.blocks.num_free == need_long - blocks_for(len(short))
    seq = TranslationSequence(translation_job(mt, long, num_beams=1))
    assert runner.reserve(seq)  # exactly enough once the kept output is given up
    assert runner.blocks_kept == 0 and runner.blocks.num_free == 0 and runner.cross_slots_held == 1
    runner.release(seq)

    small = Seq2SeqRunner(mt, num_rows=2, cuda_graphs=False, block_size=BLOCK, num_blocks=need_long)
    assert not small.reserve(TranslationSequence(translation_job(mt, long, num_beams=1)))  # one block short
    assert small.blocks.num_in_use == 0 and small.rows.num_used == 0 and small.cross_slots.num_used == 0


def test_a_glossary_job_through_the_runner_places_its_term_and_is_scored_by_teacher_forcing(mt):
    """A constrained beam job (a term the model would not write here) run through `run_jobs`: every hypothesis
    holds the term's ids, and each score is the model's summed log-probability of its ids (teacher forcing,
    one full forward pass) over their number ** length_penalty."""
    source = mt.tokenizer.encode(lexicon_sentences(1, seed=14, min_words=4, max_words=4)[0])
    job = translation_job(mt, source, num_beams=3, max_new_tokens=16)
    plain = job_tokens(mt, job)
    term = mt.tokenizer.encode("Haus", add_special_tokens=False)
    assert term and not any(plain[i:i + len(term)] == term for i in range(len(plain)))
    job.constraints, job.constraint_terms = [term], ["Haus"]
    runner = Seq2SeqRunner(mt, num_rows=3, cuda_graphs=False)
    (seq,) = run_jobs(mt, [job], runner=runner)
    hypotheses = runner.hypotheses(seq)
    assert hypotheses and seq.output_ids == hypotheses[0][0]
    src = torch.tensor([source])
    for ids, score in hypotheses:
        assert any(ids[i:i + len(term)] == term for i in range(len(ids)))
        tgt = torch.tensor([[mt.config.decoder_start_token_id, *ids[:-1]]])
        with torch.no_grad():
            logp = torch.log_softmax(mt.model(src, torch.tensor([len(source)]), tgt).float(), -1)[0]
        total = float(logp.gather(1, torch.tensor(ids)[:, None]).sum())
        assert score == pytest.approx(total / len(ids) ** mt.generation.length_penalty, abs=1e-4)
