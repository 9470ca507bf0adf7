"""Decoding: one logits pipeline, one sampler, beam search and stop strings, and the runners that apply
them to many sequences at once. The serving engines and every one-request caller (warm-up, evaluation,
attention maps) go through the same runners, so there is one rule for each next-token decision."""

from tserve.model.decoding.beam_search import BeamSearch, BeamSettings
from tserve.model.decoding.lm_runner import DecoderRunner, TextSequence, generate
from tserve.model.decoding.logits import LogitsPipeline
from tserve.model.decoding.params import SamplingParams, parse_logit_bias
from tserve.model.decoding.sampler import sample, token_logprobs
from tserve.model.decoding.seq2seq_runner import (
    Seq2SeqRunner,
    TranslationJob,
    TranslationSequence,
    translate,
    translation_job,
)
from tserve.model.decoding.speculative import Speculation
from tserve.model.decoding.stop import StopStrings

__all__ = [
    "BeamSearch", "BeamSettings", "DecoderRunner", "LogitsPipeline", "SamplingParams", "Seq2SeqRunner", "Speculation",
    "StopStrings", "TextSequence", "TranslationJob", "TranslationSequence", "generate", "parse_logit_bias",
    "sample", "token_logprobs", "translate", "translation_job",
]
