"""Beam search against `transformers`' `generate`, with one stated allowance for near-ties.

Two implementations that add the same float32 log-probabilities in another order can rank two hypotheses
whose scores differ by a few ulps either way; which one comes first then depends on the CPU's kernels, not
on the code. A comparison accepts another first hypothesis than `generate`'s only when `generate` itself
ranks ours within `TIE` of its best, and a test asserts that this happened on at most one input
(`assert_at_most_one_tie`): a real difference in the search shows up on more than one."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIE = 1e-4  # two hypotheses' scores closer than this are a tie that float rounding may break either way
SCORE_TOLERANCE = 1e-4  # our score of a hypothesis against transformers' `sequences_scores` of it


def hf_beam_hypotheses(hf, source_ids: list[int], num_beams: int, max_new_tokens: int,  # noqa: ANN001
                       pad: int) -> list[tuple[list[int], float]]:
    """`generate`'s hypotheses, best first: (ids without the decoder start and padding, score)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([source_ids]), num_beams=num_beams, num_return_sequences=num_beams,
                          do_sample=False, max_new_tokens=max_new_tokens, output_scores=True,
                          return_dict_in_generate=True)
    return [([t for t in seq[1:].tolist() if t != pad], float(score))
            for seq, score in zip(out.sequences, out.sequences_scores, strict=True)]


@dataclass
class BeamParity:
    ties: list[str] = field(default_factory=list)

    def check(self, ids: list[int], score: float, reference: list[tuple[list[int], float]], what: str) -> None:
        """Our first hypothesis (`ids`, `score`) against `generate`'s ranked `reference`."""
        (best_ids, best_score), ranked = reference[0], dict((tuple(i), s) for i, s in reversed(reference))
        if ids == best_ids:
            assert abs(score - best_score) < SCORE_TOLERANCE, (what, score, best_score)
            return
        assert tuple(ids) in ranked, f"{what}: ours {ids} is not among transformers' hypotheses {reference}"
        theirs = ranked[tuple(ids)]
        assert abs(theirs - best_score) <= TIE, (
            f"{what}: ours {ids} (transformers scores it {theirs}) differs from transformers' best {best_ids} "
            f"({best_score}) by more than a tie")
        assert abs(score - theirs) < SCORE_TOLERANCE, (what, score, theirs)
        self.ties.append(f"{what}: {ids} vs {best_ids} ({theirs} vs {best_score})")

    def assert_at_most_one_tie(self) -> None:
        assert len(self.ties) <= 1, f"more than one near-tie decided otherwise than transformers: {self.ties}"


def spelled_otherwise(tokenizer, ids: list[int], eos: int) -> bool:  # noqa: ANN001
    """Whether `ids` spell their text with other tokens than the text encodes to (e.g. an unknown token that
    decodes to nothing, or a space token before eos)."""
    own = tokenizer.encode_target(tokenizer.decode(ids))
    if ids[-1:] != [eos]:
        own = [t for t in own if t != eos]
    return own != ids
