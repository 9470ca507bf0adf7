"""Beam search with hard lexical constraints (`ConstrainedBeamSearch`), on a fixed table of next-token
log-probabilities (a bigram model): every finished hypothesis holds every constraint as a contiguous run, ends
on eos only once they are placed, and carries the score teacher forcing gives it; constraints that cannot fit
raise `ConstraintsUnmet` naming them."""

from __future__ import annotations

import pytest
import torch

from tserve.model.decoding import BeamSearch, BeamSettings
from tserve.model.decoding.constrained_beam import ConstrainedBeamSearch, ConstraintsUnmet

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

V, EOS, START = 12, 0, 1


def bigram_table(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 2
    logits[:, START] = -1e9  # never generated
    logits[:, EOS] += 1.5  # sentences end soon unless held open
    return torch.log_softmax(logits, dim=-1)


def run(search, table: torch.Tensor) -> None:  # noqa: ANN001
    while not search.done:
        search.advance(table[search.last_tokens])


def contains(ids: list[int], run_: list[int]) -> bool:
    return any(ids[i: i + len(run_)] == run_ for i in range(len(ids) - len(run_) + 1))


@pytest.mark.parametrize("seed", range(6))
def test_every_hypothesis_places_every_constraint_and_is_scored_by_its_tokens(seed):
    table = bigram_table(seed)
    constraints = [[7, 8, 9], [5]]
    settings = BeamSettings(num_beams=4, max_new_tokens=12, eos_token_id=EOS)
    search = ConstrainedBeamSearch(settings, START, constraints, ["789", "5"])
    run(search, table)
    free = BeamSearch(settings, START)
    run(free, table)
    assert not all(contains(ids, c) for ids, _ in free.hypotheses(4) for c in constraints)  # they do bind
    hyps = search.hypotheses(4)
    assert hyps and search.best() == hyps[0][0]
    assert [s for _, s in hyps] == sorted((s for _, s in hyps), reverse=True)
    for ids, score in hyps:
        assert all(contains(ids, c) for c in constraints), ids
        assert EOS not in ids[:-1]
        previous = [START] + ids[:-1]
        assert score == pytest.approx(sum(table[p, t].item() for p, t in zip(previous, ids, strict=True)) / len(ids),
                                      abs=1e-5)


def test_constraints_that_cannot_fit_name_themselves():
    settings = BeamSettings(num_beams=4, max_new_tokens=3, eos_token_id=EOS)
    search = ConstrainedBeamSearch(settings, START, [[7, 8, 9], [5]], ["789", "5"])
    run(search, bigram_table())
    with pytest.raises(ConstraintsUnmet, match="'789'|'5'"):
        search.best()


def test_a_constraint_left_unfinished_counts_for_nothing():
    search = ConstrainedBeamSearch(BeamSettings(num_beams=2, max_new_tokens=8, eos_token_id=EOS), START, [[7, 8]])
    beam = search.beams[0]
    beam = search._step(beam, 7, -1.0)
    assert beam.partial == (0, 1) and search._placed(beam) == 1
    beam = search._step(beam, 3, -1.0)
    assert beam.partial is None and not beam.met and search._placed(beam) == 0
    beam = search._step(search._step(beam, 7, -1.0), 8, -1.0)
    assert beam.met == {0} and search._placed(beam) == 2


def test_a_finished_hypothesis_is_scored_with_the_length_penalty():
    table = bigram_table(1)
    settings = BeamSettings(num_beams=4, max_new_tokens=12, eos_token_id=EOS, length_penalty=0.5)
    search = ConstrainedBeamSearch(settings, START, [[7, 8, 9]], ["789"])
    run(search, table)
    for ids, score in search.hypotheses(4):
        previous = [START] + ids[:-1]
        total = sum(table[p, t].item() for p, t in zip(previous, ids, strict=True))
        assert score == pytest.approx(total / len(ids) ** 0.5, abs=1e-5)


def test_empty_constraints_are_refused():
    settings = BeamSettings(num_beams=2, max_new_tokens=4, eos_token_id=EOS)
    for constraints in ([], [[5], []]):
        with pytest.raises(ValueError, match="^constraints must be non-empty token lists$"):
            ConstrainedBeamSearch(settings, START, constraints)
