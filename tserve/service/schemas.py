"""Request and response bodies (pydantic). Field names and shapes follow the OpenAI API where one exists;
extensions are marked."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tserve.service.request_schemas import (  # noqa: F401 - re-exported
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    RequestBody,
    ResponseFormat,
    StructuredOutputs,
    Tool,
)


class _Prioritised(RequestBody):
    priority: int | None = Field(None, ge=-1000, le=1000, description="admission priority, lower first (as vLLM's); "
                                 "default: the API key's (TSERVE_API_KEYS `KEY:N`), else 0")


class AttentionSelection(RequestBody):
    """Extension: return the attention maps of the generated tokens (non-streaming requests)."""

    layers: list[int] | None = Field(None, description="answered in the order given, each once; default: all")
    heads: list[int] | None = Field(None, description="default: all")


class StreamOptions(RequestBody):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries its choice's usage so far (a chunk may hold
    # several tokens: those waiting for a stream that fell behind).
    continuous_usage_stats: bool = False


class SamplingFields(_Prioritised):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias from -100 to 100 added to its logit; at most 300")
    user: str | None = None
    # Extensions (vLLM-compatible names).
    top_k: int = Field(0, ge=-1, description="0 or -1: no top-k filter")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


class CompletionRequest(SamplingFields):
    model: str | None = None
    # A text, texts, or as OpenAI takes them too, a prompt's token ids or several prompts' ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    return_attention: AttentionSelection | None = None
    # OpenAI's, not served: refused by name rather than ignored (a client would get other answers than it asked).
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list) -> str | list:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt list is empty")
        return v


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the assistant's header after the messages (false: the template's text ends with the last message),
    # or the last message left open for the reply to go on with it (a reply whose start is given).
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TranslationRequest(_Prioritised):
    model: str | None = Field(None, description="the translator; without it, the only one served, or the one "
                              "(or two, through --pivot-language) that source_lang → target_lang picks")
    input: str | list[str]
    # The numbers' limits are checked with every other translation rule in tserve/service/translation/inputs.py.
    num_beams: int | None = Field(None, description="1 to 16 (default: the model's)")
    max_tokens: int | None = Field(None, description="new tokens per sentence: at least 1, at most the server's "
                                   "--max-tokens-limit and the model's target length")
    n: int = Field(1, description="alternatives per input, best first: 1 to 16, at most num_beams")
    glossary: dict[str, str] | None = Field(None, description="source term -> target term: where a source term "
                                            "occurs (whole words, any case), the target term appears verbatim; "
                                            "such a sentence is searched with at least 4 beams")
    format: Literal["text", "html"] = Field("text", description="html: translate the page's text, keep its markup "
                                            "(inline tags placed by the model's alignment)")
    return_alignment: bool = Field(False, description="each input's segments with their word alignment (and, "
                                   "for html, where each inline tag went)")
    source_lang: str | None = Field(None, description="the inputs' language: ISO 639-1 / 639-3, "
                                    "BCP-47 or the model's own code (required by a multilingual model)")
    target_lang: str | None = Field(None, description="the language to translate into (required by "
                                    "a multilingual model)")
    cache: bool = Field(True, description="false: translate every sentence again rather than answer those the "
                        "translation memory holds from it")
    stream: bool = False
    return_attention: AttentionSelection | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("input list is empty")
        return v


class ClassificationRequest(_Prioritised):
    model: str | None = None
    image: str | None = Field(None, description="base64-encoded image (PNG, JPEG, ... anything Pillow reads)")
    images: list[str] | None = None
    top_k: int = Field(5, ge=1)


class LogitLensRequest(RequestBody):
    model: str | None = None
    input: str = Field(description="the LM's text, or the translation source")
    target: str | None = Field(None, description="translation: the target to inspect (default: the model's own "
                                                 "translation, exactly what /v1/translations returns)")
    layers: list[int] | None = Field(None, description="0 is the embedding output, i the stream after block i; "
                                                       "answered in the order given, each once; default: all")
    top_k: int = Field(5, ge=1, le=20)
    source_lang: str | None = Field(None, description="a multilingual translator's source language "
                                    "(as /v1/translations takes it)")
    target_lang: str | None = Field(None, description="a multilingual translator's target language")


class LensToken(BaseModel):
    token: str
    prob: float


class LensPosition(BaseModel):
    token: str = Field(description="the (target) token at this position")
    top: list[LensToken] = Field(description="the distribution for the next position, most likely first")


class LensLayerOut(BaseModel):
    layer: int
    positions: list[LensPosition]


class LogitLensResponse(BaseModel):
    model: str
    tokens: list[str]
    layers: list[LensLayerOut]


class EmbeddingRequest(_Prioritised):
    """OpenAI's embeddings request; `image` / `images` (base64) are the extension for image models."""

    model: str | None = None
    input: str | list[str] | None = Field(None, description="text(s) to embed (language models, translators)")
    image: str | None = Field(None, description="base64 image (ViT)")
    images: list[str] | None = None
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="the vectors' length: the model's own (it cannot shorten "
                                   "them); another is refused")
    source_lang: str | None = Field(None, description="a multilingual translator's input language "
                                    "(as /v1/translations takes it; default: its tokenizer's)")
    user: str | None = None


class AttentionRequest(RequestBody):
    model: str | None = None
    input: str | None = Field(None, description="LM text, or the translation source")
    target: str | None = Field(None, description="translation target to score (default: the model's own translation)")
    image: str | None = Field(None, description="base64 image (ViT)")
    layers: list[int] | None = Field(None, description="answered in the order given, each once; default: all")
    heads: list[int] | None = Field(None, description="default: all")
    format: Literal["json", "png", "bertviz"] = "json"
    rollout: bool = Field(False, description="png of a ViT: attention rollout across the selected layers")
    source_lang: str | None = Field(None, description="a multilingual translator's source language "
                                    "(as /v1/translations takes it)")
    target_lang: str | None = Field(None, description="a multilingual translator's target language")


# --------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens read from the prefix cache instead of computed")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AttentionMapOut(BaseModel):
    module: Literal["decoder.self", "encoder.self", "decoder.cross"]
    layer: int
    query_tokens: list[str]
    key_tokens: list[str]
    weights: list[list[list[float]]] = Field(description="[head][query][key]; each row sums to 1")


class AttentionMaps(BaseModel):
    maps: list[AttentionMapOut]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    attention: AttentionMaps | None = Field(None, description="with return_attention")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Alternative(BaseModel):
    translation: str
    score: float


class TagPlacementOut(BaseModel):
    tag: str = Field(description="the open tag as written (an atom such as <br> or a comment: all of it)")
    kind: Literal["span", "atom"]
    depth: int = Field(description="0 for a segment's own tags, 1 inside one span, ...")
    source_words: list[int] = Field(description="a span: the source words it wraps")
    target_words: list[int] = Field(description="a span: the target words it was placed around")
    source_boundary: int | None = Field(None, description="an atom: it stood before this source word")
    target_boundary: int | None = Field(None, description="an atom: it was put before this target word")


class SegmentAlignment(BaseModel):
    source: str = Field(description="the text the model read (for html: a block's text, markup removed)")
    translation: str
    source_words: list[str]
    target_words: list[str]
    alignment: list[int] = Field(description="per target word, the source word it was read from (-1: none)")
    tags: list[TagPlacementOut] | None = Field(None, description="format html: the block's inline markup")


class TranslationItem(BaseModel):
    index: int
    translation: str
    score: float = Field(description="length-normalised log-probability (token-weighted mean over sentences)")
    alternatives: list[Alternative] | None = Field(None, description="with n > 1: best first, distinct")
    attention: AttentionMaps | None = Field(None, description="with return_attention")
    segments: list[SegmentAlignment] | None = Field(None, description="with return_alignment: the best "
                                                    "translation's segments (sentences; html: blocks)")


class AttentionResponse(BaseModel):
    """`/v1/attention` as JSON; a task may add fields of its own (a translation's `target`)."""

    model_config = ConfigDict(extra="allow")
    model: str
    maps: list[AttentionMapOut]
    target: str | None = Field(None, description="translation: the target the maps read")


class BertVizResponse(BaseModel):
    """`/v1/attention` with format bertviz: transformers' `output_attentions` shapes, per layer
    [1][head][query][key]; encoder-decoders give the encoder_/decoder_/cross_ fields."""

    model_config = ConfigDict(extra="forbid")
    model: str
    attention: list[list[list[list[list[float]]]]] | None = None
    tokens: list[str] | None = None
    encoder_attention: list[list[list[list[list[float]]]]] | None = None
    decoder_attention: list[list[list[list[list[float]]]]] | None = None
    cross_attention: list[list[list[list[list[float]]]]] | None = None
    encoder_tokens: list[str] | None = None
    decoder_tokens: list[str] | None = None


class TranslationResponse(BaseModel):
    object: Literal["translation"] = "translation"
    model: str
    models: list[str] | None = Field(None, description="without 'model': the models the pair went through, in "
                                     "order (two when it was pivoted)")
    data: list[TranslationItem]
    usage: Usage


class Prediction(BaseModel):
    label: str
    score: float


class ClassificationItem(BaseModel):
    index: int
    predictions: list[Prediction]


class ClassificationResponse(BaseModel):
    object: Literal["classification"] = "classification"
    model: str
    data: list[ClassificationItem]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class LanguagePair(BaseModel):
    source: str
    target: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tserve"
    task: str = Field(description="text-generation, translation, image-classification, or a task that "
                                  "--task-modules added")
    languages: LanguagePair | None = Field(None, description="a translator's languages, when its checkpoint "
                                           "names them")
    language_codes: list[str] | None = Field(None, description="a multilingual translator's languages, in its own "
                                             "codes (source_lang / target_lang also take ISO 639 and BCP-47)")
    max_model_len: int | None = Field(None, description="a language model's context as served: prompt + "
                                      "completion tokens")
    kv_cache_bytes_per_token: int | None = Field(None, description="a language model's KV cache per token "
                                                 "(2 x layers x kv heads x head size x dtype size)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --------------------------------------------------------------------------------------------------
# Open Inference Protocol (KServe / Triton v2)
# --------------------------------------------------------------------------------------------------
class OIPTensor(BaseModel):
    """An input or output tensor: `data` is the flat row-major list of its `shape`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str
    datatype: str
    shape: list[int] = Field(description="non-negative dimensions")
    data: list[Any]
    parameters: dict[str, Any] | None = None

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError("dimensions must be non-negative")
        return v

    @model_validator(mode="after")
    def _size(self) -> OIPTensor:
        expected = 1
        for d in self.shape:
            expected *= d
        if len(self.data) != expected:
            raise ValueError(f"'data' has {len(self.data)} elements; shape {self.shape} needs {expected}")
        return self


class OIPRequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class OIPInferenceRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    inputs: list[OIPTensor] = Field(min_length=1, max_length=1, description="exactly one tensor")
    outputs: list[OIPRequestedOutput] | None = None
    parameters: dict[str, Any] | None = Field(None, description="the model's options (a tensor's own win)")


class OIPInferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OIPTensor]


class OIPTensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class OIPModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[OIPTensorMetadata]
    outputs: list[OIPTensorMetadata]


def inline_json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` written in place, for `openapi_extra` request bodies (whose
    `#/$defs/...` references would otherwise point at the root of the OpenAPI document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
