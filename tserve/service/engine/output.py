"""The output stage: what a request's client receives for each token the runner chose. Detokenizing,
stop strings, logprob formatting and the finish reason the text implies; the runner has already applied
its finish rule (eos, max_tokens, context) and says which (`finish`). No model work, no scheduling."""

from __future__ import annotations

from dataclasses import dataclass

from tserve.model.decoding import StopStrings
from tserve.model.decoding.lm_runner import StepLogprobs
from tserve.model.detokenizer import IncrementalDetokenizer
from tserve.model.tokenizer import Tokenizer
from tserve.service.engine.request import Event, TokenLogprob


def token_logprob(tokenizer: Tokenizer, k: int, token: int, row: int, logprobs: StepLogprobs) -> TokenLogprob:
    """Row `row` of a step's logprobs as the chosen token's entry with its `k` most likely alternatives."""
    chosen, top_v, top_i = logprobs
    # Tokens a constraint rules out (a grammar's mask) have no probability: they are not alternatives.
    top = {tokenizer.tokens([t])[0]: v for t, v in zip(top_i[row][:k], top_v[row][:k], strict=True)
           if v != float("-inf")}
    return TokenLogprob(tokenizer.tokens([token])[0], chosen[row], top)


def text_event(detok: IncrementalDetokenizer, stops: StopStrings, token: int, is_eos: bool, finish: str | None,
               lp: TokenLogprob | None) -> Event:
    """An LM token as text: an eos that ends the sequence is not part of the output (its flush is); a stop
    string cuts the text and finishes with "stop", also when the last flush completes one."""
    start = len(detok.text)
    if is_eos:
        text = stops.close(detok.flush())[0]
    else:
        text, stopped = stops.feed(detok.push(token))
        if not stopped and finish is not None:  # the last text may complete a stop string too
            tail, stopped = stops.close(detok.flush())
            text += tail
        if stopped:
            finish = "stop"
    return Event(text, [] if is_eos else [token], [lp] if lp is not None and not is_eos else [], finish,
                 text_start=start)


@dataclass
class Hypothesis:
    """One finished translation: its text, ids (eos included when reached) and the score beam search ranks by."""

    text: str
    token_ids: list[int]
    score: float


def greedy_translation_event(detok: IncrementalDetokenizer, token: int, finish: str | None,
                             final: list[Hypothesis] | None = None) -> Event:
    """A greedy translation streams its text token by token; the eos that ends it adds no text. The last
    event carries the finished hypothesis (`final`) as its result."""
    if finish == "stop":  # eos
        text = detok.flush()
    else:
        text = detok.push(token) + (detok.flush() if finish else "")
    return Event(text, [token], finish_reason=finish, result=final)


def beam_translation_event(final: list[Hypothesis], finish: str) -> Event:
    """A beam search answers once, with its best hypothesis as the text and all of them as the result."""
    return Event(final[0].text, final[0].token_ids, finish_reason=finish, result=final)
