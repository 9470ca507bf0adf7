"""Continuous batching for an encoder-decoder translator, beam search included. The `Seq2SeqRunner` does
the model work (encoder into cross slots, one decoder batch for every running row, beam reordering) and the
next-token rules; this engine schedules requests onto it and hands each token to the output stage (`output.py`).

The decoder rows' KV blocks and the encoded sources' cross-attention blocks come from one pool sized by
`--kv-cache-memory` (default: every row's whole length and a whole source per row, at most a share of the free
memory). Admission counts rows and the blocks of a request's source and first position; when the pool runs dry
mid-decode, encoder outputs kept for reuse give way first, then the newest running requests are preempted and later replay their positions (the
runner's docstring), so they finish with the tokens they would have had and a stream repeats nothing."""

from __future__ import annotations

import time

import torch

from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import Seq2SeqRunner, TranslationJob, TranslationSequence, translate
from tserve.model.decoding.seq2seq_runner import REPLAYED, row_blocks
from tserve.model.detokenizer import IncrementalDetokenizer
from tserve.service.engine.kv_memory import kv_cache_blocks
from tserve.service.engine.output import Hypothesis, beam_translation_event, greedy_translation_event
from tserve.service.engine.request import EngineRequest, InvalidInput
from tserve.service.engine.translation_input import Translator
from tserve.service.engine.worker import Worker, overlaps
from tserve.service.metrics import Metrics


class SegmentRequest(EngineRequest, TranslationSequence):
    def __init__(self, job: TranslationJob, deadline: float, detokenizer: IncrementalDetokenizer) -> None:
        EngineRequest.__init__(self, deadline)
        TranslationSequence.__init__(self, job)
        self.detok = detokenizer
        self.input_tokens = len(job.source_ids)


class TranslationEngine(Worker):
    def __init__(self, name: str, loaded: LoadedModel, *, max_rows: int, max_queue: int, timeout_s: float,
                 metrics: Metrics, cuda_graphs: bool = True, max_len: int | None = None,
                 reuse_sources: bool = True, async_scheduling: str = "auto", kv_cache_budget: tuple[int | None, float | None] = (None, None),
                 kv_block_size: int = 16) -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_rows)
        self.loaded, self.tokenizer, self.cfg, self.device = loaded, loaded.tokenizer, loaded.config, loaded.device
        self.overlap = overlaps(async_scheduling, self.device)  # greedy rows' steps
        cfg, bs = loaded.config, kv_block_size
        target_len = min(cfg.max_target_len, max_len or cfg.max_target_len)
        source_len = min(cfg.max_source_len, max_len or cfg.max_source_len)
        # At least the blocks of one request with the checkpoint's beams and its longest source, at its longest.
        least = -(-source_len // bs) + loaded.generation.num_beams * -(-target_len // bs)
        num_blocks = kv_cache_blocks(loaded, kv_cache_budget, bs, max_rows, row_blocks(source_len, target_len, bs),
                                     least=least)
        self.runner = Seq2SeqRunner(loaded, num_rows=max_rows, cuda_graphs=cuda_graphs, max_len=max_len,
                                    reuse_sources=reuse_sources, num_blocks=num_blocks, block_size=kv_block_size)
        self.translator = Translator(loaded, self.runner.max_source_len, self.runner.max_target_len)
        self.rows, self.cross_slots = self.runner.rows, self.runner.cross_slots
        pool = self.runner.cache.self_kv  # (the encoded sources' blocks too)
        self.m.kv_bytes_per_token.set(pool.bytes_per_token())
        self.m.kv_bytes.set(pool.nbytes())
        self.m.kv_blocks_total.set(self.runner.blocks.num_usable)
        self.m.kv_block_size.set(kv_block_size)

    def submit(self, job: TranslationJob, group: object | None = None, turn: int = 0) -> SegmentRequest:
        """Queue a translation (raises QueueFull or ValueError), as part `turn` of client request `group` when
        given (a document's sentences). Must be called on the event loop."""
        if job.num_beams > self.rows.num_slots:
            raise InvalidInput(f"num_beams {job.num_beams} exceeds the {self.rows.num_slots} decoder rows this "
                               "server runs (--max-running-requests)", param="num_beams")
        if self.runner.blocks_needed(job) > self.runner.blocks.num_usable:
            raise ValueError(f"{job.num_beams} beams of {job.max_new_tokens} tokens need "
                             f"{self.runner.blocks_needed(job)} KV-cache blocks; the cache has "
                             f"{self.runner.blocks.num_usable} (--kv-cache-memory): lower max_tokens or num_beams")
        req = SegmentRequest(job, time.perf_counter() + self.timeout_s, IncrementalDetokenizer(self.tokenizer))
        self._enqueue(req, group, turn)
        return req

    def submit_job(self, job: TranslationJob, **part: object) -> SegmentRequest:
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

    def _rows_needed(self, req: SegmentRequest) -> int:
        return req.job.num_beams

    def _reserve(self, req: SegmentRequest) -> bool:
        if not self.runner.reserve(req, spare=self.runner.blocks_for_next_step(self.running)):
            return False
        if req.encoded:  # an identical source's encoder output, still in its cross slot
            self.m.encoder_reuses.inc()
        return True

    def _release(self, req: SegmentRequest) -> None:
        self.runner.release(req)

    def _prefill(self, reqs: list[SegmentRequest]) -> None:
        self._isolated(reqs, self._encode, self._begin)

    def _encode(self, reqs: list[SegmentRequest]) -> None:
        self.runner.encode(reqs)
        self.m.batch_size.observe(len(reqs))

    def _begin(self, reqs: list[SegmentRequest], _: None) -> None:
        self._each(reqs, self.runner.begin)

    def _decode(self) -> None:
        while not self._make_room():
            self._read_tokens()  # a preempted request replays from every token it has
        reqs = [r for r in self.running if not self.runner.ends_by_length(r)]
        if reqs:
            self._isolated(sorted(reqs, key=lambda r: r.rows[0]), self._decode_forward, self._advance)

    def _make_room(self) -> bool:
        """Blocks for the position every running request writes next, oldest first; when none is free, the newest
        request holding rows is preempted (it may be the one asking). False when a preemption is due while tokens
        are on their way: the caller reads them and asks again."""
        order = [r for r in self.running if not self.runner.ends_by_length(r)]  # admission order
        for req in order:
            while req.rows and not self.runner.grow(req):
                if self._in_flight:
                    return False
                self._preempt(next(r for r in reversed(order) if r.rows))
        return True

    def _preempt(self, req: SegmentRequest) -> None:
        """Free its rows, blocks and cross slot (its encoder output, kept for reuse, stays until its blocks are
        needed) and put it back at the head of the queue; admitted again, it
        replays its positions and goes on."""
        self.runner.preempt(req)
        self._requeue_preempted(req, req.resume_at)

    def _update_gauges(self) -> None:
        super()._update_gauges()
        self.m.kv_blocks_in_use.set(self.runner.blocks_in_use)

    def _decode_forward(self, reqs: list[SegmentRequest]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        logits, spans = self.runner.decode(reqs)
        self.m.batch_size.observe(spans[-1][1])
        return logits, spans

    def _advance(self, reqs: list[SegmentRequest], output: tuple[torch.Tensor, list[tuple[int, int]]]) -> None:
        """Batched first (the runner chooses every row's token), then each request's own part (text,
        events) in isolation. A beam group whose step failed cannot run again: its requests fail. Greedy rows'
        tokens are read from the device later (`_take`), after the next step is launched with `overlap`."""
        failed: set[int] = set()

        def fail_group(group: list[SegmentRequest], exc: Exception) -> None:
            failed.update(map(id, group))
            for r in group:
                self._fail(r, exc)

        tokens, greedy = self.runner.advance_later(reqs, *output, on_group_error=fail_group)
        later = set() if greedy is None else set(map(id, greedy.seqs))
        self._record([r for r in reqs if id(r) not in failed and id(r) not in later],
                     {id(r): t for r, t in zip(reqs, tokens, strict=True)})
        if greedy is not None:
            self._launched(greedy.seqs, greedy)

    def _take(self, reqs: list[SegmentRequest], tokens: list[int], logprobs: tuple | None) -> None:
        for req, logprob in zip(reqs, logprobs[0], strict=True):
            req.logprob_sum += logprob
        self._record(reqs, {id(r): t for r, t in zip(reqs, tokens, strict=True)})

    def _record(self, reqs: list[SegmentRequest], token: dict[int, int | None]) -> None:
        """Each request's token of a step (None: a beam request's step, `REPLAYED`: a recomputed position):
        counted, appended, and its event or, once it ends, its hypotheses published."""
        now = time.perf_counter()
        finishing: dict[int, str] = {}

        def record(req: SegmentRequest) -> None:
            if token[id(req)] == REPLAYED:  # a position of its cache recomputed after a preemption
                return
            self._step_tokens += 1
            finish = self.runner.append(req, token[id(req)])
            if finish is not None:
                finishing[id(req)] = finish
            elif req.greedy:
                self._publish(req, greedy_translation_event(req.detok, token[id(req)], None), now)

        self._each(reqs, record)
        done = [r for r in reqs if id(r) in finishing and not r.finished]

        def publish(req: SegmentRequest) -> None:
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
