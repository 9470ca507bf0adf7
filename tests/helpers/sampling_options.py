"""Every sampling and stopping option the API accepts, on its own and beside the others, for the tests whose
contract is equality with plain decoding (speculative decoding, the prefix cache, preemption): each option
changes what the cycle fixture (`fixture_training.CYCLE_TEXT`) writes, so that a path that drops or misapplies
one gives other tokens. `streamed` runs jobs through an engine and collects each request's tokens and text."""

from __future__ import annotations

import asyncio

from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import SamplingParams
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
