"""Every sampling and stopping option the API accepts, on its own and beside the others, for the tests whose
contract is equality with plain decoding (speculative decoding, the prefix cache, preemption): each option
changes what the cycle fixture (`fixture_training.CYCLE_TEXT`) writes, so that a path that drops or misapplies
one gives other tokens. `streamed` runs jobs through an engine and collects each request's tokens and text."""

from __future__ import annotations

import asyncio

from tests.helpers.fixture_training import cycle_prompts
from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import SamplingParams
from tserve.model.decoding.structured import Constraint
from tserve.service.engine import GenerationEngine


def option_matrix(lm: LoadedModel) -> dict[str, SamplingParams]:
    eos = lm.tokenizer.eos_id
    banned = lm.tokenizer.encode(" Hallo", add_special_tokens=False)[0]
    return {
        "greedy": SamplingParams(max_tokens=16, temperature=0.0),
        "logit_bias bans a token the cycle writes": SamplingParams(max_tokens=16, temperature=0.0,
                                                                   logit_bias={banned: -100.0}),
        "min_tokens holds back an eos the bias makes likely": SamplingParams(
            max_tokens=16, temperature=0.0, min_tokens=3, logit_bias={eos: 50.0}),
        "penalties": SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4),
        "stop strings": SamplingParams(max_tokens=20, temperature=0.0, stop=["Morgen", "is "]),
        "seeded sampling, top_k": SamplingParams(max_tokens=16, temperature=0.8, top_k=5, seed=7),
        "seeded sampling, top_p, logprobs": SamplingParams(max_tokens=16, temperature=1.2, top_p=0.9, seed=11,
                                                          logprobs=3),
        "seeded sampling, min_tokens, bias, stop": SamplingParams(
            max_tokens=16, temperature=0.9, seed=5, min_tokens=4, logit_bias={eos: 6.0}, stop=["Tag"]),
        "ignore_eos with an eos bias": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                      logit_bias={eos: 50.0}),
    }


def streamed(engine: GenerationEngine, jobs: list[tuple[list[int], SamplingParams]],
             stop: bool = True) -> list[tuple[list[int], str]]:
    """Every job submitted at once; each request's tokens and text as its stream gave them (`stop`: the engine
    is stopped afterwards)."""
    async def one(req) -> tuple[list[int], str]:  # noqa: ANN001
        ids, text = [], ""
        async for event in engine.stream(req):
            ids += event.token_ids
            text += event.text
        return ids, text

    async def run() -> list:
        reqs = [engine.submit(p, sp) for p, sp in jobs]
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        return asyncio.run(run())
    finally:
        if stop:
            engine.stop()


def events(engine: GenerationEngine, jobs: list, cancel_after: dict[int, int] | None = None) -> list[list[tuple]]:
    """Every job submitted at once; each request's events as (text, token ids, logprobs, finish reason), then
    the tokens it counts once finished. `cancel_after`: job index -> events after which its client leaves."""
    async def one(i: int, req) -> list[tuple]:  # noqa: ANN001
        out = []
        async for event in engine.stream(req):
            out.append((event.text, event.token_ids, [(lp.token, round(lp.logprob, 5), sorted(lp.top))
                                                      for lp in event.logprobs], event.finish_reason))
            if cancel_after and len(out) == cancel_after.get(i):
                return out
        return [*out, ("tokens counted", req.generated, req.finish_reason)]  # what usage reports

    async def run() -> list:
        reqs = [engine.submit(p, sp) for p, sp in jobs]
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def option_jobs(lm: LoadedModel, engine: GenerationEngine, grammars: bool = True) -> list:
    """Each option of the API and (`grammars`) two grammars, on two prompts, all in one batch."""
    options = dict(option_matrix(lm))
    if grammars:
        digits = engine.runner.grammars.compile(Constraint("regex", "[0-9]{2,6}( [a-z]{1,5}){0,3}"))
        options["grammar, greedy"] = SamplingParams(max_tokens=16, temperature=0.0, grammar=digits)
        options["grammar, seeded"] = SamplingParams(max_tokens=16, temperature=1.0, seed=3, grammar=digits)
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(2, seed=31)]
    return [(p, sp) for sp in options.values() for p in prompts]
