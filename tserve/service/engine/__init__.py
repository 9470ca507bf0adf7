"""The workers that hold requests: one `Worker` (queue, admission, cancel, timeout, drain, call jobs) with a
runner per model kind beneath it and an output stage (text, stop strings, logprobs, events) above it."""

from tserve.service.engine.batcher import BatchItem, DynamicBatcher
from tserve.service.engine.generation import GenerationEngine, GenerationRequest
from tserve.service.engine.request import (
    Admission,
    CallRequest,
    EngineRequest,
    Event,
    InvalidInput,
    OutOfMemory,
    QueueFull,
    RequestTimeout,
    ShuttingDown,
    TokenLogprob,
    admission,
    request_error,
    request_observer,
)
from tserve.service.engine.translation import SegmentRequest, TranslationEngine
from tserve.service.engine.worker import Worker

__all__ = ["Admission", "BatchItem", "CallRequest", "DynamicBatcher", "EngineRequest", "Event", "GenerationEngine",
           "GenerationRequest", "InvalidInput", "OutOfMemory", "QueueFull", "RequestTimeout", "ShuttingDown", "Worker", "TokenLogprob",
           "TranslationEngine", "SegmentRequest", "admission", "request_error", "request_observer"]
