"""The one-request path: `model.decoding.generate` / `translate` with one input alone, in the shapes the
tests compare the engines and the HTTP API with."""

from __future__ import annotations

from collections.abc import Sequence

from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import SamplingParams, TranslationJob, generate, translate
from tserve.model.decoding.seq2seq_runner import run_jobs


def lm_tokens(loaded: LoadedModel, prompt: Sequence[int], params: SamplingParams, *, with_eos: bool = True) -> list[int]:
    """Generated ids of one prompt alone; the eos that ended it last (unless `with_eos` is False)."""
    (seq,) = generate(loaded, [prompt], params)
    eos = [] if seq.finish_reason != "stop" or not with_eos else [seq.next_token]
    return seq.generated + eos


def mt_tokens(loaded: LoadedModel, source: Sequence[int], num_beams: int = 1, max_new_tokens: int | None = None) -> list[int]:
    """Translation ids of one source alone (eos included when reached)."""
    return translate(loaded, [source], num_beams, max_new_tokens)[0].output_ids


def job_tokens(loaded: LoadedModel, job: TranslationJob) -> list[int]:
    """What one translation job gives alone."""
    return run_jobs(loaded, [job])[0].output_ids


def assert_translations_as_alone(loaded: LoadedModel, jobs: Sequence[TranslationJob], results: Sequence,
                                 expected: Sequence[list[int]]) -> None:
    """Each engine result (streamed ids and text) is what its job gives alone."""
    for job, result, ref in zip(jobs, results, expected, strict=True):
        assert result.token_ids == ref, job
        assert result.text == loaded.tokenizer.decode(ref)
