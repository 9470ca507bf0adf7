"""A translator's requests as the engine takes them: each input text encoded in its languages and cut into
sentences that fit the model, one `TranslationJob` per sentence (with glossary terms as constraints). The
request's own rules (counts, lengths, options) are checked before, in `service.translation.inputs`; what only
the tokenizer can tell (a sentence too long to cut, a page without text, a glossary term without tokens) is
refused here with `InvalidInput`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import TranslationJob, translation_job
from tserve.model.decoding.constrained_beam import ConstraintsUnmet
from tserve.model.html_markup import Markup, parse_html
from tserve.model.segmentation import Document, Span, split_document
from tserve.service.engine.request import InvalidInput

# A multilingual model's (source, target) language codes; a tagged model (MADLAD-400) may leave the source out.
Languages = tuple[str | None, str]


@dataclass
class DocumentJob:
    """One input text: its layout and segments (`model.segmentation.Document`) and a job per segment."""

    document: Document
    jobs: list[TranslationJob]
    # HTML input: the page's markup, and each of its blocks' sentences (`document` then lists them all in order)
    markup: Markup | None = None
    blocks: list[Document] | None = None
    languages: Languages | None = None  # a multilingual model's (source, target) codes


class Translator:
    """A translator's requests as the engine takes them: sources encoded in their languages, cut into sentences
    that fit the model, one job each with the checkpoint's generation defaults (the request's rules are checked
    before, in `service.translation.inputs`)."""

    def __init__(self, loaded: LoadedModel, max_source_len: int | None = None, max_target_len: int | None = None) -> None:
        """The limits: the runner's (--max-model-len), at most the model's."""
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.cfg, self.gen = loaded.config, loaded.generation
        self.max_source_len = max_source_len or self.cfg.max_source_len
        self.max_target_len = max_target_len or self.cfg.max_target_len

    def encode_source(self, text: str, languages: Languages | None) -> list[int]:
        """A source's ids; a multilingual model's in the source language (`Tokenizer.source_in`)."""
        return self.tokenizer.source_in(text, languages)

    def _default_max_tokens(self) -> int:
        return min(self.gen.max_new_tokens, self.max_target_len)

    def forced_first(self, languages: Languages | None) -> int | None:
        """A multilingual model's first target token: the target language's code (none for a tagged model)."""
        prefix = self.tokenizer.target_prefix(languages)
        return prefix[0] if prefix else None

    def encode_target(self, text: str, languages: Languages | None) -> list[int]:
        """A target's ids as the decoder reads them, eos left out (a multilingual model's language code first)."""
        prefix = self.tokenizer.target_prefix(languages)
        if not prefix:
            return [t for t in self.tokenizer.encode_target(text) if t != self.cfg.eos_token_id]
        return [*prefix, *self.tokenizer.encode(text, add_special_tokens=False)]

    def job(self, text: str, num_beams: int | None, max_tokens: int | None,
            languages: Languages | None = None) -> TranslationJob:
        ids = self.encode_source(text, languages)
        if len(ids) > self.max_source_len:
            raise InvalidInput(f"input has {len(ids)} tokens; this model takes at most {self.max_source_len}")
        return translation_job(self.loaded, ids, num_beams, max_tokens or self._default_max_tokens(),
                               self.forced_first(languages))

    def document(self, text: str, num_beams: int | None, max_tokens: int | None,
                 glossary: dict[str, str] | None = None, languages: Languages | None = None) -> DocumentJob:
        """`text` as sentences (`model.segmentation`), each cut further until the model takes it whole; one
        job per segment. A segment in which glossary source terms occur (whole words, any case) must place
        their target terms: hard constraints of a beam search with at least 4 beams. `languages`: a
        multilingual model's (source, target) codes. The request's numbers were checked before
        (`service.translation.inputs`)."""
        ids: dict[str, list[int]] = {}

        def fits(segment: str) -> bool:
            ids[segment] = self.encode_source(segment, languages)
            return len(ids[segment]) <= self.max_source_len

        def keep(sentence: str) -> list[Span]:
            return self._glossary_spans(sentence, glossary or {}, fits)

        doc = split_document(text, fits, keep if glossary else None)
        return self._jobs(doc, ids, num_beams, max_tokens, glossary, languages)

    def _glossary_spans(self, sentence: str, glossary: dict[str, str], fits: Callable[[str], bool]) -> list[Span]:
        """Where glossary source terms occur in a sentence too long for the model, overlapping occurrences as
        one span: the cut keeps each whole, so that its piece places the term. A span the model cannot take
        whole would be cut, its term placed nowhere: refused, naming the terms (422)."""
        found = sorted((m.start(), m.end(), source) for source in glossary for m in _occurrences(source, sentence))
        spans: list[tuple[int, int, list[str]]] = []
        for start, end, source in found:
            if spans and start < spans[-1][1]:
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]), [*spans[-1][2], source])
            else:
                spans.append((start, end, [source]))
        if long := [s for start, end, sources in spans if not fits(sentence[start:end]) for s in sources]:
            raise ConstraintsUnmet(list(dict.fromkeys(long)), f"are longer than this model's input of "
                                   f"{self.max_source_len} tokens and cannot be kept in one piece")
        return [(start, end) for start, end, _ in spans]

    def html_document(self, page: str, num_beams: int | None, max_tokens: int | None,
                      glossary: dict[str, str] | None = None, languages: Languages | None = None) -> DocumentJob:
        """An HTML page: each block's text (model.html_markup) cut into sentences like a text's, one job per
        sentence, all blocks in order. A page without text to translate is refused."""
        markup = parse_html(page)
        if not markup.blocks:
            raise InvalidInput("the page holds no text to translate", "empty_input")
        return self.markup_document(markup, num_beams, max_tokens, glossary, languages)

    def markup_document(self, markup: Markup, num_beams: int | None, max_tokens: int | None,
                        glossary: dict[str, str] | None = None, languages: Languages | None = None) -> DocumentJob:
        """Blocks of text with markup (an HTML page's, a file's paragraphs): each block's text cut into
        sentences like a text's, one job per sentence, all blocks in order."""
        docs = [self.document(b.text, num_beams, max_tokens, glossary, languages) for b in markup.blocks]
        segments = [seg for d in docs for seg in d.document.segments]
        return DocumentJob(Document(segments, [""] * (len(segments) + 1)), [j for d in docs for j in d.jobs],
                           markup, [d.document for d in docs], languages)

    def _jobs(self, doc: Document, ids: dict[str, list[int]], num_beams: int | None, max_tokens: int | None,
              glossary: dict[str, str] | None, languages: Languages | None) -> DocumentJob:
        jobs = []
        for seg in doc.segments:
            job = translation_job(self.loaded, ids.get(seg) or self.encode_source(seg, languages), num_beams,
                                  max_tokens or self._default_max_tokens(), self.forced_first(languages))
            terms = [target for source, target in (glossary or {}).items() if _occurs(source, seg)]
            if terms:
                self._constrain(job, list(dict.fromkeys(terms)))
            jobs.append(job)
        return DocumentJob(doc, jobs, languages=languages)

    def _constrain(self, job: TranslationJob, terms: list[str]) -> None:
        eos = self.cfg.eos_token_id  # the terms' pieces alone: no eos, no language code
        job.constraints = [[t for t in self.tokenizer.encode_target(term, add_special_tokens=False) if t != eos]
                           for term in terms]
        job.constraint_terms = terms
        if empty := [term for term, ids in zip(terms, job.constraints, strict=True) if not ids]:
            raise InvalidInput(f"glossary target terms with no tokens for this model: {empty}", "invalid_glossary")
        job.num_beams = max(job.num_beams, MIN_CONSTRAINED_BEAMS)
        if sum(map(len, job.constraints)) + 1 > job.max_new_tokens:
            raise ConstraintsUnmet(terms)


MIN_CONSTRAINED_BEAMS = 4


def _occurrences(term: str, text: str) -> Iterator[re.Match[str]]:
    """`term` in `text` as whole words, in any case."""
    return re.finditer(rf"(?<!\w){re.escape(term)}(?!\w)", text, flags=re.IGNORECASE)


def _occurs(term: str, text: str) -> bool:
    return next(_occurrences(term, text), None) is not None
