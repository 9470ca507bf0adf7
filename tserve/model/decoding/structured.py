"""Structured output: a grammar (JSON schema, regex, a list of choices, Lark or GBNF) as a per-row token mask.

The grammar work is llguidance's: a tokenizer's every token as bytes (byte-level BPE and SentencePiece with byte
fallback alike, read from its tokenizer.json), an Earley parser over a lazily built lexer, and the mask of the
tokens that may come next. A grammar is compiled once per tokenizer and cached by its text; each sequence gets a
copy of the compiled matcher (`deep_copy`), which the runner advances with every token it appends. The mask is one
more rule of the logits pipeline (`LogitsPipeline.grammar`), so constrained and free rows share a batch, and
beams, seeds and logprobs read the masked scores like any other constraint's.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

try:
    # Not `llguidance.torch`: it compiles a kernel with torch.compile at import, which loads dynamo and inductor
    # (seconds of start-up for every server) for a mask fill that is one call into the matcher.
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF / EBNF (`::=`) to Lark; Lark as it is
except ImportError:  # pragma: no cover - a dependency of the project; kept optional for model-only installs
    llguidance = None

KINDS = ("json", "regex", "choice", "grammar")
MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A constraint that cannot be compiled (the library's message), or took too long to."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `json`: a JSON schema (as JSON text; `{"type": "object"}` for any
    object); `regex`: a regular expression the whole output matches; `choice`: exactly one of the strings in
    `spec` (a JSON list); `grammar`: a Lark grammar (llguidance's dialect), or GBNF / EBNF (`::=` rules, as
    llama.cpp writes them)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {KINDS}")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (raises GrammarError)."""
        if llguidance is None:
            raise GrammarError("structured output needs the llguidance package")
        try:
            if self.kind == "json":
                # Compact JSON (no free whitespace): a model cannot run out its tokens on blanks.
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.spec, defaults={"whitespace_flexible": False})
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                options = json.loads(self.spec)
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.spec))
        except Exception as exc:  # the library's parsers raise several kinds; each message is the client's
            raise GrammarError(f"invalid {self.kind} constraint: {exc}") from exc

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


class GrammarCompiler:
    """One model's grammar compiler: its tokenizer as llguidance sees it (built on first use, ~1 s for a
    150k vocabulary), and the compiled grammars, most recently used kept, by the constraint's hash."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: Sequence[int],
                 max_compile_ms: float = 2000.0) -> None:
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, list(eos_ids)
        self.max_compile_ms = max_compile_ms
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles run here, so that one that outlasts --max-grammar-compile-ms can be abandoned to finish alone
        # (a Rust call cannot be interrupted) while the request is refused.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    @property
    def supported(self) -> bool:
        return llguidance is not None and self._json is not None

    def _lltokenizer(self):  # noqa: ANN202 - llguidance.LLTokenizer
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids or None)
            return self._tokenizer

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled constraint (cached); raises GrammarError with the library's message, or when the
        compile takes longer than `max_compile_ms`."""
        if not self.supported:
            raise GrammarError("this model's tokenizer has no tokenizer.json: structured output is not available")
        key = constraint.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        tokenizer = self._lltokenizer()  # built once per model (~1 s at 150k tokens); not the request's compile
        future = self._pool.submit(self._compile, constraint, tokenizer)
        try:
            matcher = future.result(timeout=self.max_compile_ms / 1000)
        except concurrent.futures.TimeoutError as exc:
            raise GrammarError(f"the {constraint.kind} constraint took longer than {self.max_compile_ms:g} ms "
                               "to compile (--max-grammar-compile-ms)") from exc
        compiled = CompiledGrammar(constraint, matcher, self.vocab_size)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint, tokenizer: Any):  # noqa: ANN202 - llguidance.LLMatcher
        matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {constraint.kind} constraint: {matcher.get_error()}")
        return matcher


class CompiledGrammar:
    """A compiled constraint: `matcher()` gives each sequence its own state."""

    def __init__(self, constraint: Constraint, template: Any, vocab_size: int) -> None:
        self.constraint, self._template, self.vocab_size = constraint, template, vocab_size

    def matcher(self) -> GrammarState:
        return GrammarState(self._template.deep_copy(), self.vocab_size)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size

    def fill_mask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 (rows, words) CPU bitmask."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not words.is_contiguous() or words.device.type != "cpu":
            raise ValueError("a grammar mask is a contiguous int32 CPU tensor")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def advance(self, token: int) -> None:
        """Take the token the sequence chose (it was allowed by the mask)."""
        self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (not even more of an open string)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


def mask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def masks_for(states: Sequence[GrammarState], vocab_size: int) -> Tensor:
    """The (len(states), words) int32 bitmask of the allowed next tokens of each state, on the CPU."""
    bitmask = torch.empty(len(states), mask_words(vocab_size), dtype=torch.int32)
    for i, state in enumerate(states):
        state.fill_mask(bitmask, i)
    return bitmask


def disallowed(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(rows, vocab) bool: True where a token is not allowed (the bitmask's bit is 0)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1  # (rows, words, 32), little-endian within a word
    return allowed.reshape(bitmask.size(0), -1)[:, :vocab_size] == 0
