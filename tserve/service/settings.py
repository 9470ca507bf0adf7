"""Server settings: every option is a `TSERVE_*` environment variable and (for the common ones) a CLI
flag. This is the only module that reads the environment."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tserve.model.quantize import INT4_GROUP_SIZES

BUNDLED_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TSERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: all interfaces)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    # NAME=PATH (a directory or a .gguf file) or NAME=ORG/REPO[@REVISION][:FILE.gguf or QUANT] (a Hugging Face repo
    # id) entries; empty = the bundled models.
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    models_dir: Path = Field(BUNDLED_MODELS_DIR, description="where the bundled models are (served without --model)")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: CUDA when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    quantize: Literal["auto", "none", "int8", "int4", "q8_0", "q4_0"] = Field(
        "auto", description="int8: int8 weights for every linear layer of every model; int4: group-wise int4 "
        "weights, the output (vocabulary) layer int8; q8_0 / q4_0: llama.cpp's blocks of 32 weights with one scale, on our AVX-512 VNNI / AVX2 "
        "kernels (float32 on the CPU only); auto: a block-quantized GGUF file's nearest (Q8_0 and Q4_0: q8_0 / q4_0 on "
        "the file's own blocks; Q5 / Q6: int8; Q4_K, Q4_1 and smaller: int4), none for every other checkpoint")
    int4_group_size: int = Field(
        32, description="with --quantize int4: weights per scale and zero, 32, 64 or 128 (smaller: more accurate, "
        "more bytes)")
    int8_activations: Literal["auto", "full", "split", "7bit", "7bit-weights"] = Field(
        "auto", description="with --quantize int8: activations as one 8-bit GEMM (full: PyTorch's kernel with "
        "VNNI or AMX, our exact AVX2 kernel elsewhere), as two 7-bit halves (split: any CPU, twice the GEMM rows), "
        "7-bit (7bit: any CPU, least accurate) or 8-bit with 7-bit weights (7bit-weights: any CPU, 7bit's "
        "speed); auto: full where PyTorch's or our kernel takes it, split elsewhere")
    attention_backend: Literal["auto", "math", "sdpa", "flash", "flash-decode", "cpu-decode"] = Field(
        "auto", description="attention kernels (auto: flash-decode on CUDA, cpu-decode on the CPU where its C++ "
        "kernel builds, else sdpa)")
    cuda_graphs: bool = Field(
        True, description="on CUDA, replay LM decode steps from CUDA graphs captured per batch-size bucket")
    fused_layers: bool = Field(
        True, description="on the CPU, run a language model's one-token decode steps through all its layers in one "
        "C++ call (float32, Q8_0 / Q4_0 weights; layouts it does not compute keep their layers)")
    compile: bool = Field(False, description="compile the LM decode step with torch.compile (slower start-up)")
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto", description="language models and greedy translation: launch each decode step before reading the "
        "tokens of the one before "
        "(the host detokenizes, streams and plans while the device computes; a request's last step is computed "
        "once more and dropped); auto: on CUDA, off on the CPU, where nothing runs beside the host")
    gc_freeze: bool = Field(
        True, description="once the models are loaded and warmed up, put every object then alive out of the garbage "
        "collector's reach (gc.freeze): a full collection then walks only what serving allocated, not the models' "
        "and libraries' objects, and stops the process for milliseconds instead of a tenth of a second "
        "(--no-gc-freeze: off)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="JSON logs to stderr")

    # Generation engine (one per language model).
    max_running_requests: int = Field(16, ge=1, description="KV-cache rows per generative model (a beam request takes num_beams)")
    reserved_rows: int = Field(0, ge=0, description="rows of each generative model a client with requests running "
                               "may not take: kept for another client's first request (fair admission)")
    max_queue: int = Field(256, ge=0, description="client requests waiting per model before 429 (a request counts once, with all its parts); 0: no waiting room, a request is taken only when free rows take it at once")
    max_model_len: int | None = Field(None, ge=2, description="cap on prompt + completion tokens (default: the model's context, at most 4096; the KV cache holds this many positions per running request); a translator's source tokens and target tokens, each (default: the model's)")
    kv_cache_memory: str | None = Field(
        None, description="KV cache of each language model (a translator: its decoder's): bytes (2GB, 512MiB) or a fraction of the memory free on "
        "its device (0.3); default: every running request's whole context, at most 0.4 of the free memory")
    kv_block_size: int = Field(16, ge=1, le=1024, description="positions per KV-cache block")
    prefix_cache: bool = Field(True, description="language models: requests share the KV blocks of a common "
                               "prompt prefix, computed once; translators: a source identical to one encoded "
                               "before reads its encoder output (--no-prefix-cache: off)")
    speculative: Literal["off", "ngram"] = Field(
        "off", description="language models: ngram = speculative decoding with prompt-lookup drafts (a step scores "
        "tokens guessed from the request's own context; greedy output unchanged, sampled output from the same "
        "distribution)")
    draft_model: str | None = Field(
        None, description="language models: speculative decoding with drafts from this smaller model of the same "
        "tokenizer (a checkpoint directory or a Hugging Face repo id), decoded greedily k tokens ahead; greedy "
        "output unchanged, sampled output from the same distribution")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="with --speculative ngram or --draft-model: draft "
                                        "tokens per step")
    prompt_lookup_max: int = Field(3, ge=1, le=16, description="with --speculative ngram: longest suffix (tokens) "
                                   "looked up in the context")
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="with --speculative ngram: shortest suffix looked up")
    speculative_max_rows: int = Field(4, ge=1, description="with --speculative ngram or --draft-model: draft only while at most this "
                                      "many requests run (more make a CPU step compute-bound)")
    keep_alive_s: int = Field(75, ge=1, description="idle seconds before a keep-alive connection is closed")
    request_timeout_s: float = Field(300.0, gt=0, description="seconds a generation request may take in all")
    max_tokens_limit: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    max_grammar_compile_ms: float = Field(
        2000.0, gt=0, description="structured output: the longest a request's JSON schema, regex or grammar may "
        "take to compile before the request is refused with 400 (compiled grammars are cached)")
    max_n: int = Field(8, ge=1, description="largest `n` (choices per prompt)")
    max_prompts: int = Field(32, ge=1, description="largest list of prompts / inputs / images in one request")

    # Dynamic batching (translation, classification).
    batch_max_size: int = Field(16, ge=1, description="largest classification batch")
    batch_max_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits to fill up while items keep arriving (an item on an idle worker runs at once)")

    # Input limits.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body (413 above)")
    max_image_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest encoded image")
    max_file_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="largest file to translate (413 above)")
    max_unzipped_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="a zip container's (.docx, .pptx, "
                                    ".odt, .odp, .epub) entries together, unpacked (400 above)")
    file_dir: str | None = Field(None, description="directory of translated files (default: tserve-files in "
                                 "the system's temporary directory)")
    file_retention_s: float = Field(3600.0, gt=0, description="seconds a translated file is kept after its job "
                                    "ends (then it and its job are deleted)")
    translation_memory: str | None = Field(None, description="SQLite file of the translation memory (survives "
                                           "restarts; several processes may share it); default: in memory")
    translation_memory_max_entries: int = Field(100_000, ge=0, description="sentence translations the memory "
                                                "keeps, least recently used dropped first (0: no memory)")
    max_image_pixels: int = Field(40_000_000, ge=1, description="largest image width x height")
    max_attention_floats: int = Field(2_000_000, ge=1, description="most attention weights one request may return")
    max_input_chars: int = Field(100_000, ge=1, description="longest prompt / translation input")
    max_glossary_entries: int = Field(64, ge=1, description="largest translation glossary (source term -> target term)")
    pivot_language: str = Field("en", description="/translate and /v1/translations without a model: a pair no served translator has "
                                "goes through this language in two hops when two translators chain through it")
    prefer_multilingual: bool = Field(False, description="/translate and /v1/translations without a model: a pair that a one-pair model "
                                      "(opus-mt) and a multilingual one (NLLB) both serve goes to the multilingual one")
    max_lens_entries: int = Field(200_000, ge=1, description="largest /v1/logit_lens answer: layers x positions x top_k")

    # Access.
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted API keys (comma-separated); empty: no authentication")
    public_paths: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["/healthz", "/readyz", "/metrics"], description="paths open without a key")
    max_requests_per_key: int = Field(0, ge=0, description="requests in flight per API key (0: no limit)")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins allowed by CORS (comma-separated); empty: CORS closed")
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="keys of the model repository API (/v2/repository, comma-separated); "
        "with API keys but no admin keys it is closed")

    # The model repository API (load, replace and unload models at run time).
    model_repository: Path | None = Field(None, description="directory of checkpoint directories (and GGUF files) that "
                                          "/v2/repository/models/NAME/load loads by name")
    allow_load_paths: bool = Field(False, description="let a load request name a checkpoint path of its own")
    max_model_memory: str | None = Field(None, description="the weights of every model served, together, at most "
                                         "(e.g. 8GB, 512MiB; a model --quantize quantizes counted as it will be held); a load "
                                         "past it is refused before its weights are read")

    task_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="more task modules to import (comma-separated dotted paths), each "
        "registering a ServedModel for a checkpoint task")

    otlp_endpoint: str | None = Field(None, description="OpenTelemetry collector (OTLP/HTTP) to send request traces "
                                      "to (default: OTEL_EXPORTER_OTLP_ENDPOINT; neither: no tracing)")
    log_prompts: bool = Field(False, description="log prompt / input text (off: user text never reaches the logs)")
    warmup: bool = Field(True, description="run one request through each model before turning ready")

    @field_validator("models", "api_keys", "admin_keys", "public_paths", "cors_origins", "task_modules",
                     mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        # From the environment: "lm=/path,mt=/other" (or a JSON list, which pydantic-settings parses).
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @property
    def max_model_memory_bytes(self) -> int | None:
        return None if self.max_model_memory is None else parse_bytes(self.max_model_memory)

    @field_validator("max_model_memory")
    @classmethod
    def _memory_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_bytes(value)
        return value

    @property
    def kv_cache_budget(self) -> tuple[int | None, float | None]:
        """--kv-cache-memory as (bytes, None) or (None, fraction of the free memory); (None, None) when not given."""
        return parse_memory_share(self.kv_cache_memory)

    @model_validator(mode="after")
    def _one_kind_of_draft(self) -> Settings:
        if self.draft_model and self.speculative != "off":
            raise ValueError("--draft-model and --speculative ngram are two kinds of drafts: choose one")
        return self

    @field_validator("models_dir", "model_repository", "file_dir", "translation_memory", "draft_model")
    @classmethod
    def _home_expanded(cls, value: Path | str | None) -> Path | str | None:
        """`~` in a path is the user's home, as a shell expands it on a command line: the environment files of
        compose, Kubernetes and Ray leave it as it is (`--model` paths are expanded in `model_specs`). A draft
        model named by a repo id has no `~` to expand."""
        if isinstance(value, Path):
            return value.expanduser()
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    @field_validator("int4_group_size")
    @classmethod
    def _int4_group_size(cls, value: int) -> int:
        if value not in INT4_GROUP_SIZES:
            raise ValueError(f"must be one of {INT4_GROUP_SIZES}")
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory_share(cls, value: str | None) -> str | None:
        parse_memory_share(value)
        return value

    def model_specs(self) -> dict[str, Path]:
        """NAME -> checkpoint directory, or Hugging Face repo id (`ORG/REPO[@REVISION]`, resolved when the model
        is loaded: `model.hub`). Without --model: every checkpoint under models/."""
        if not self.models:
            return checkpoint_dirs(self.models_dir)
        specs: dict[str, Path] = {}
        for entry in self.models:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--model takes NAME=PATH or NAME=ORG/REPO[@REVISION], got {entry!r}")
            if name in specs:
                raise ValueError(f"model name {name!r} given twice")
            specs[name] = Path(path).expanduser()
            if path.startswith(("./", "../")):  # written as a path: it stays one (`org/name` alone is a repo id)
                specs[name] = specs[name].absolute()
        return specs


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value: str) -> int:
    """'8GB', '512MiB', '1.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size such as 8GB, 512MiB or 1000000")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def parse_memory_share(value: str | None) -> tuple[int | None, float | None]:
    """'2GB', '512MiB', '1000000' -> (bytes, None); '0.3' (a fraction in (0, 1]) -> (None, 0.3); None -> (None, None)."""
    if value is None:
        return None, None
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", value):
        fraction = float(value)
        if not 0 < fraction <= 1:
            raise ValueError(f"{value!r}: a fraction of the free memory lies in (0, 1]")
        return None, fraction
    return parse_bytes(value), None


def checkpoint_dirs(root: Path | None) -> dict[str, Path]:
    """NAME -> directory for each checkpoint directory (one with a config.json) in `root`, and NAME -> file for
    each GGUF file there (NAME: the file's name without `.gguf`; a directory of the same name wins)."""
    if root is None or not root.is_dir():
        return {}
    files = {f.name.removesuffix(".gguf"): f for f in sorted(root.glob("*.gguf")) if f.is_file()}
    return files | {d.name: d for d in sorted(root.iterdir()) if (d / "config.json").is_file()}
