"""Structured output in the runner (tserve/model/decoding/structured.py): the grammar's mask on each constrained row,
advanced with every token, on every tokenizer kind a served LM has: byte-level BPE from vocab.json + merges
(GPT-2), byte-level BPE in tokenizer.json (Qwen2) and SentencePiece with byte fallback (Mistral)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tserve.model import checkpoint
from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import SamplingParams, generate
from tserve.model.decoding.lm_runner import DecoderRunner
from tserve.model.decoding.structured import Constraint, GrammarError, masks_for

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

KINDS = ["gpt2", "qwen2", "mistral"]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict schemas have
    name: str = Field(max_length=8)
    country: str = Field(max_length=8)
    population: int = Field(ge=0, le=9_999)
    capital: bool


CITY = json.dumps(City.model_json_schema())


@dataclass
class LM:
    loaded: LoadedModel
    runner: DecoderRunner

    def prompts(self, n: int, seed: int = 0) -> list[list[int]]:
        return [self.loaded.tokenizer.encode(t)[:10] for t in cycle_prompts(n, seed=seed)]  # room for the answer

    def grammar(self, kind: str, spec: str):  # noqa: ANN201
        return self.runner.grammars.compile(Constraint(kind, spec))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[str, str]]:
        out = generate(self.loaded, prompts, params, runner=self.runner)
        return [(self.loaded.tokenizer.decode(s.generated), s.finish_reason) for s in out]


@pytest.fixture(scope="module")
def lms(tmp_path_factory) -> dict[str, LM]:
    root = tmp_path_factory.mktemp("structured")
    dirs = {"gpt2": factories.tiny_lm_dir(root / "gpt2"), "qwen2": factories.hf_family_dir("qwen2", root / "qwen2"),
            "mistral": factories.hf_family_dir("mistral", root / "mistral")}
    lms = {}
    for kind, d in dirs.items():
        loaded = checkpoint.load(d)
        lms[kind] = LM(loaded, DecoderRunner(loaded, num_slots=8, cuda_graphs=False))
    return lms


def allowed_ids(mask, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_ascii_document_walks_the_mask_token_by_token(lms, kind):
    """Each step, among the tokens the mask allows, take the longest whose bytes continue the document: the
    walk reaches the end (umlauts, a dash, CJK: byte-fallback pieces on SentencePiece), our tokenizer decodes
    the walk to the same text, eos is refused until the document is complete and allowed after."""
    lm = lms[kind]
    runner = lm.runner
    text = json.dumps({"name": "Köln–東京", "country": "Grüße", "population": 1084, "capital": False},
                      ensure_ascii=False, separators=(",", ":"))
    state = lm.grammar("json", CITY).matcher()
    lltok = runner.grammars._lltokenizer()
    pieces = {t: lltok.decode_bytes([t]) for t in range(runner.vocab_size)}
    target, walked, ids = text.encode(), b"", []
    while walked != target:
        allowed = allowed_ids(masks_for([state], runner.vocab_size), runner.vocab_size)
        assert not allowed & runner.eos_ids, "eos allowed before the document is complete"
        rest = target[len(walked):]
        fits = [t for t in allowed if pieces[t] and rest.startswith(pieces[t])]
        assert fits, (kind, walked.decode(errors="replace"))
        best = max(fits, key=lambda t: len(pieces[t]))
        ids.append(best)
        walked += pieces[best]
        state.advance(best)
    assert lm.loaded.tokenizer.decode(ids) == text
    assert state.finished or allowed_ids(masks_for([state], runner.vocab_size), runner.vocab_size) & runner.eos_ids


@pytest.mark.parametrize("kind", KINDS)
def test_every_sampled_answer_that_stops_validates(lms, kind):
    lm = lms[kind]
    prompts = lm.prompts(50, seed=1)  # 50 varied requests
    grammar = lm.grammar("json", CITY)
    answers = lm.generate(prompts, [SamplingParams(max_tokens=100, temperature=1.0, seed=i, grammar=grammar)
                                    for i in range(len(prompts))])
    stopped = [text for text, reason in answers if reason == "stop"]
    assert len(stopped) >= 10, answers
    for text in stopped:
        City.model_validate_json(text)
    for text, reason in answers:
        assert reason in ("stop", "length")
        assert text.startswith('{"name":"'), text  # cut by max_tokens, still on the grammar's path
    # Unconstrained, the same model writes prose: the constraint is what makes the answers parse.
    free = lm.generate(prompts[:12], [SamplingParams(max_tokens=48, temperature=1.0, seed=i) for i in range(12)])
    invalid = 0
    for text, _ in free:
        try:
            City.model_validate_json(text)
        except ValidationError:
            invalid += 1
    assert invalid == len(free)


@pytest.mark.parametrize("kind", KINDS)
def test_choice_regex_and_grammars(lms, kind):
    lm = lms[kind]
    prompts = lm.prompts(8, seed=2)
    options = ["grün", "Straße", "日本語", "no"]
    sampled = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(8)]

    def constrained(kind_: str, spec: str) -> list[tuple[str, str]]:
        grammar = lm.grammar(kind_, spec)
        return lm.generate(prompts, [SamplingParams(**{**vars(p), "grammar": grammar}) for p in sampled])

    picks = constrained("choice", json.dumps(options, ensure_ascii=False))
    assert all(reason == "stop" and text in options for text, reason in picks), picks
    dates = constrained("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]")
    assert all(re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]", t) and r == "stop" for t, r in dates), dates
    for grammar in ('root ::= "yes" | "no" | "maybe " [a-z]+', 'start: "yes" | "no" | "maybe " /[a-z]+/'):
        out = constrained("grammar", grammar)  # GBNF, then Lark
        assert all(re.fullmatch(r"yes|no|maybe [a-z]+", t) for t, _ in out if _ == "stop"), out
        assert all(re.fullmatch(r"(yes|no|maybe [a-z]*)", t) for t, _ in out), out


def test_constrained_and_free_rows_share_a_batch_and_keep_their_tokens(lms):
    """Batch invariance with grammars: every row, constrained or not, gets what it gets alone."""
    lm = lms["qwen2"]
    prompts = lm.prompts(6, seed=3)
    grammar = lm.grammar("json", CITY)
    choice = lm.grammar("choice", json.dumps(["ja", "nein"]))
    params = [SamplingParams(max_tokens=24, temperature=t, seed=i, grammar=g)
              for i, (t, g) in enumerate([(0.0, grammar), (0.0, None), (1.0, grammar), (1.0, None), (1.0, choice),
                                          (0.0, choice)])]
    together = lm.generate(prompts, params)
    alone = [lm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    assert together[1][0] != together[0][0] and together[0][0].startswith('{"name":')


def test_bad_constraints_are_refused_with_the_libraries_message_and_good_ones_are_cached(lms):
    lm = lms["gpt2"]
    for kind, spec, words in (("regex", "((", "unclosed group"), ("json", '{"type": "nonsense"}', "nonsense"),
                              ("grammar", "start: undefined_rule", "undefined_rule")):
        with pytest.raises(GrammarError, match=words):
            lm.grammar(kind, spec)
    assert lm.grammar("json", CITY) is lm.grammar("json", CITY)
    assert lm.grammar("json", CITY) is not lm.grammar("json", json.dumps({"type": "object"}))


def test_a_grammar_slower_than_the_limit_is_refused(lms, monkeypatch):
    """A compile that outlasts --max-grammar-compile-ms is refused (and finishes alone in its thread)."""
    compiler = lms["gpt2"].runner.grammars
    compile_ = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda c, t: (time.sleep(0.3), compile_(c, t))[1])
    monkeypatch.setattr(compiler, "max_compile_ms", 50.0)
    with pytest.raises(GrammarError, match="max-grammar-compile-ms"):
        compiler.compile(Constraint("regex", "slow[0-9]+"))
    monkeypatch.setattr(compiler, "max_compile_ms", 2000.0)
    assert compiler.compile(Constraint("regex", "slow[0-9]+")) is not None


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    platform: int = Field(ge=1, le=20)
    open: bool


def _valid(text: str) -> bool:
    try:
        Record.model_validate_json(text)
    except ValidationError:
        return False
    return True


def test_a_model_that_writes_json_like_text_is_always_valid_under_the_schema(tmp_path):
    """A fixture trained on station records, a quarter of them broken: free, it writes broken records too;
    under the schema all 50 answers validate, and each one the free model already got right is unchanged (the
    mask only removes tokens, so the same random draws pick the same allowed tokens)."""
    loaded = checkpoint.load(factories.json_lm_dir(tmp_path / "json-lm"))
    lm = LM(loaded, DecoderRunner(loaded, num_slots=8, cuda_graphs=False))
    prompt = loaded.tokenizer.encode("Record: ")
    free = [(text.split("\n")[0], reason) for text, reason in  # the record: its line (stop strings are the engine's)
            lm.generate([prompt] * 50, [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(50)])]
    valid = [_valid(text) for text, _ in free]
    assert 10 <= sum(valid) < 50, free  # writes records, and breaks some
    grammar = lm.grammar("json", json.dumps(Record.model_json_schema()))
    constrained = lm.generate([prompt] * 50, [SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=grammar)
                                              for i in range(50)])
    assert all(reason == "stop" and _valid(text) for text, reason in constrained), constrained
    for (free_text, _), (text, _), ok in zip(free, constrained, valid, strict=True):
        if ok:
            assert text == free_text
        else:
            assert text != free_text


def test_without_llguidance_a_constraint_says_what_is_missing(monkeypatch):
    import tserve.model.decoding.structured as structured

    monkeypatch.setattr(structured, "llguidance", None)
    with pytest.raises(GrammarError, match="^structured output needs the llguidance package$"):
        Constraint("json", "{}").grammar()


def test_the_most_recently_used_grammars_are_kept(lms, monkeypatch):
    import tserve.model.decoding.structured as structured

    compiler = lms["gpt2"].runner.grammars
    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMARS", 2)
    first, second = (compiler.compile(Constraint("regex", f"kept{i}[0-9]")) for i in range(2))
    assert compiler.compile(Constraint("regex", "kept0[0-9]")) is first  # used again: the newest now
    compiler.compile(Constraint("regex", "kept2[0-9]"))  # one too many: the least recently used goes
    assert compiler.compile(Constraint("regex", "kept0[0-9]")) is first
    assert compiler.compile(Constraint("regex", "kept1[0-9]")) is not second


def test_refusals_of_a_constraint_say_why():
    with pytest.raises(ValueError, match=r"^unknown constraint kind 'xml'; expected one of \("):
        Constraint("xml", "<a/>")
    with pytest.raises(GrammarError, match="^this model's tokenizer has no tokenizer.json: structured output is"):
        structured_compiler(None).compile(Constraint("json", "{}"))


def structured_compiler(tokenizer_json):  # noqa: ANN001, ANN201
    from tserve.model.decoding.structured import GrammarCompiler

    return GrammarCompiler(tokenizer_json, 10, [0])


def test_a_grammar_mask_must_be_a_contiguous_int32_cpu_tensor(lms):
    import torch

    state = lms["gpt2"].runner.grammars.compile(Constraint("regex", "[0-9]+")).matcher()
    with pytest.raises(ValueError, match="^a grammar mask is a contiguous int32 CPU tensor$"):
        state.fill_mask(torch.zeros(1, 4, dtype=torch.int64), 0)
