"""Continuous batching for an encoder-decoder translator, beam search included. The `Seq2SeqRunner` does
the model work (encoder into cross slots, one decoder batch for every running row, beam reordering) and the
next-token rules; this engine schedules requests onto it and hands each token to the output stage (`output.py`)."""

from __future__ import annotations

import time

import torch

from model.checkpoint import LoadedModel
from model.decoding import Seq2SeqRunner, TranslationJob, TranslationSequence, translate
from model.tokenizer import IncrementalDetokenizer
from service.engine.output import Hypothesis, beam_translation_event, greedy_translation_event
from service.engine.request import EngineRequest
from service.engine.scheduler import Scheduler
from service.metrics import Metrics
from service.runners import Translator


class TranslationRequest(EngineRequest, TranslationSequence):
    def __init__(self, job: TranslationJob, deadline: float, detokenizer: IncrementalDetokenizer) -> None:
        EngineRequest.__init__(self, deadline)
        TranslationSequence.__init__(self, job)
        self.detok = detokenizer
        self.input_tokens = len(job.source_ids)


class TranslationEngine(Scheduler):
    def __init__(self, name: str, loaded: LoadedModel, *, max_rows: int, max_queue: int, timeout_s: float,
                 metrics: Metrics, cuda_graphs: bool = True, max_len: int | None = None,
                 reuse_sources: bool = True) -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_rows)
        self.loaded, self.tokenizer, self.cfg, self.device = loaded, loaded.tokenizer, loaded.config, loaded.device
        self.runner = Seq2SeqRunner(loaded, num_rows=max_rows, cuda_graphs=cuda_graphs, max_len=max_len,
                                    reuse_sources=reuse_sources)
        self.translator = Translator(loaded, self.runner.max_source_len, self.runner.max_target_len)
        self.rows, self.cross_slots = self.runner.rows, self.runner.cross_slots

    def submit(self, job: TranslationJob, group: object | None = None, turn: int = 0) -> TranslationRequest:
        """Queue a translation (raises QueueFull or ValueError), as part `turn` of client request `group` when
        given (a document's sentences). Must be called on the event loop."""
        if job.num_beams > self.rows.num_slots:
            raise ValueError(f"num_beams {job.num_beams} exceeds the {self.rows.num_slots} decoder rows this "
                             "server runs (--max-running-requests)")
        req = TranslationRequest(job, time.perf_counter() + self.timeout_s, IncrementalDetokenizer(self.tokenizer))
        self._enqueue(req, group, turn)
        return req

    def submit_job(self, job: TranslationJob, **part: object) -> TranslationRequest:
        return self.submit(job, **part)

    def warm_up(self) -> None:
        """One short source through this engine's runner (before `start`), greedy and with the checkpoint's
        beams, so that the first real request does not pay for lazy initialisation."""
        source = self.tokenizer.encode("Hello")
        translate(self.loaded, [source, source], max_new_tokens=2, runner=self.runner)
        translate(self.loaded, [source], num_beams=1, max_new_tokens=2, runner=self.runner)

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        return self.rows.num_used

    def _rows_needed(self, req: TranslationRequest) -> int:
        return req.job.num_beams

    def _reserve(self, req: TranslationRequest) -> bool:
        if not self.runner.reserve(req):
            return False
        if req.encoded:  # an identical source's encoder output, still in its cross slot
            self.m.encoder_reuses.inc()
        return True

    def _release(self, req: TranslationRequest) -> None:
        self.runner.release(req)

    def _prefill(self, reqs: list[TranslationRequest]) -> None:
        self._isolated(reqs, self._encode, self._begin)

    def _encode(self, reqs: list[TranslationRequest]) -> None:
        self.runner.encode(reqs)
        self.m.batch_size.observe(len(reqs))

    def _begin(self, reqs: list[TranslationRequest], _: None) -> None:
        self._each(reqs, self.runner.begin)

    def _decode(self) -> None:
        self._isolated(sorted(self.running, key=lambda r: r.rows[0]), self._decode_forward, self._advance)

    def _decode_forward(self, reqs: list[TranslationRequest]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        logits, spans = self.runner.decode(reqs)
        self.m.batch_size.observe(spans[-1][1])
        return logits, spans

    def _advance(self, reqs: list[TranslationRequest], output: tuple[torch.Tensor, list[tuple[int, int]]]) -> None:
        """Batched first (the runner chooses every row's token), then each request's own part (text,
        events) in isolation. A beam group whose step failed cannot run again: its requests fail."""
        failed: set[int] = set()

        def fail_group(group: list[TranslationRequest], exc: Exception) -> None:
            failed.update(map(id, group))
            for r in group:
                self._fail(r, exc)

        tokens = self.runner.advance(reqs, *output, on_group_error=fail_group)
        token = {id(r): t for r, t in zip(reqs, tokens, strict=True)}
        now = time.perf_counter()
        finishing: dict[int, str] = {}

        def record(req: TranslationRequest) -> None:
            self.m.generated_tokens.inc()
            finish = self.runner.append(req, token[id(req)])
            if finish is not None:
                finishing[id(req)] = finish
            elif req.greedy:
                self._publish(req, greedy_translation_event(req.detok, token[id(req)], None), now)

        self._each([r for r in reqs if id(r) not in failed], record)
        done = [r for r in reqs if id(r) in finishing and not r.finished]

        def publish(req: TranslationRequest) -> None:
            final = self.runner.final_hypotheses(req, self.tokenizer)
            if isinstance(final, Exception):
                raise final
            final, finish = [Hypothesis(*h) for h in final], finishing[id(req)]
            if req.greedy:
                self._publish(req, greedy_translation_event(req.detok, token[id(req)], finish, final), now)
            else:
                self._publish(req, beam_translation_event(final, finish), now)

        for req in done:  # (not `_each`: the fault hook has seen these requests in `record`)
            try:
                publish(req)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                self._fail(req, exc)
