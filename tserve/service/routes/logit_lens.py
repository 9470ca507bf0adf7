"""`/v1/logit_lens`: each layer's next-token guesses at every position of a language model's input or a
translator's target, run as a call job of the model's worker (queue limits, deadline, its thread)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tserve.service.errors import bad_request
from tserve.service.routes.deps import ready_registry, served_model
from tserve.service.schemas import LogitLensRequest, LogitLensResponse

router = APIRouter(tags=["attention"])


@router.post("/v1/logit_lens", response_model=LogitLensResponse,
             responses={400: {"description": "invalid request, model or selection"},
                        404: {"description": "unknown model"}, 429: {"description": "queue full (Retry-After)"}})
async def logit_lens(body: LogitLensRequest, request: Request) -> Any:
    name = body.model
    if name is None:  # the only model with a lens
        candidates = [m.name for m in ready_registry(request).models.values() if m.has_logit_lens]
        if len(candidates) != 1:
            raise bad_request("say which model with 'model'", "model_required")
        name = candidates[0]
    served = served_model(request, name, None)
    context = await served.attention_context(request, body)  # a translator's own translation, when no target
    result = await served.call(request, "logit lens", "invalid_lens_request", served.logit_lens, body,
                               context)
    return {"model": served.name, **result}
