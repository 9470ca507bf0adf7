"""Continuous batching for an encoder-decoder translator, beam search included.

A request is admitted by running its encoder (batched with the other admissions) and writing its
cross-attention keys/values once into a cross slot. Every decoder step then advances all running requests
together: a greedy request is one row of the batch, a beam request `num_beams` rows whose self-attention
cache rows are reordered in place by beam parent. Finished requests leave at once and free their rows.
Beam search is the one-request `BeamSearch` fed with this request's rows of the batched logits, so its
result does not depend on what else runs.
"""

from __future__ import annotations

import time

import torch

from model.beam_search import BeamSearch
from model.checkpoint import LoadedModel
from model.cuda_graphs import BucketedDecode, default_buckets
from model.generation import ban_tokens
from model.kv_cache import SlotAllocator
from model.tokenizer import IncrementalDetokenizer
from service.engine import EngineRequest, Event, StepEngine
from service.metrics import Metrics
from service.runners import TranslationJob, Translator


class TranslationRequest(EngineRequest):
    def __init__(self, job: TranslationJob, deadline: float, detokenizer: IncrementalDetokenizer) -> None:
        super().__init__(deadline)
        self.job = job
        self.rows: list[int] = []  # self-attention cache rows: 1 (greedy) or num_beams
        self.cross_slot = -1
        self.search: BeamSearch | None = None
        self.generated: list[int] = []  # greedy output so far (eos included once reached)
        self.detok = detokenizer

    @property
    def greedy(self) -> bool:
        return self.job.num_beams == 1


class TranslationEngine(StepEngine):
    def __init__(self, name: str, loaded: LoadedModel, *, max_rows: int, max_queue: int, timeout_s: float,
                 metrics: Metrics, cuda_graphs: bool = True) -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_rows)
        self.translator = Translator(loaded)
        self.model, self.tokenizer, self.cfg = loaded.model, loaded.tokenizer, loaded.config
        self.device = loaded.device
        self.rows = SlotAllocator(max_rows)
        self.cross_slots = SlotAllocator(max_rows)
        self.graphed: BucketedDecode | None = None
        if cuda_graphs and self.device.type == "cuda" and not self.cfg.n_experts:  # MoE routing: dynamic shapes
            self.cache = self.model.new_cache(max_rows + 1, max_rows + 1)
            self.graphed = static_decode(self.model, self.cache, scratch=max_rows, max_batch=max_rows,
                                         use_graphs=True)
            self.graphed.capture()
        else:
            self.cache = self.model.new_cache(max_rows, max_rows)

    def submit(self, job: TranslationJob) -> TranslationRequest:
        """Queue a translation (raises QueueFull or ValueError). Must be called on the event loop."""
        if job.num_beams > self.rows.num_slots:
            raise ValueError(f"num_beams {job.num_beams} exceeds the {self.rows.num_slots} decoder rows this "
                             "server runs (--max-running-requests)")
        req = TranslationRequest(job, time.perf_counter() + self.timeout_s, IncrementalDetokenizer(self.tokenizer))
        self._enqueue(req)
        return req

    def submit_job(self, job: TranslationJob) -> TranslationRequest:
        return self.submit(job)

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        return self.rows.num_used

    def _reserve(self, req: TranslationRequest) -> bool:
        if self.rows.num_free < req.job.num_beams or not self.cross_slots.num_free:
            return False
        req.rows = self.rows.allocate(req.job.num_beams)
        req.cross_slot = self.cross_slots.allocate(1)[0]
        return True

    def _release(self, req: TranslationRequest) -> None:
        if req.rows:
            self.rows.free(req.rows)
            req.rows = []
        if req.cross_slot >= 0:
            self.cross_slots.free([req.cross_slot])
            req.cross_slot = -1

    def _prefill(self, reqs: list[TranslationRequest]) -> None:
        self._isolated(reqs, self._encode, self._begin)

    def _encode(self, reqs: list[TranslationRequest]) -> None:
        """Encode the admitted sources as one padded batch into their cross slots."""
        lengths = [len(r.job.source_ids) for r in reqs]
        src = torch.full((len(reqs), max(lengths)), self.cfg.pad_token_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            src[i, : lengths[i]] = torch.tensor(r.job.source_ids)
        dev = self.device
        self.model.start(src.to(dev), torch.tensor(lengths, device=dev), self.cache,
                         torch.tensor([r.cross_slot for r in reqs], device=dev))
        self.m.batch_size.observe(len(reqs))

    def _begin(self, reqs: list[TranslationRequest], _: None) -> None:
        # Buffers as wide as the longest possible output, so that any beam requests can be stacked.
        width = self.cfg.max_target_len + 1

        def begin(req: TranslationRequest) -> None:
            if not req.greedy:
                req.search = BeamSearch(self.translator.beam_settings(req.job), self.cfg.decoder_start_token_id,
                                        device=self.device, width=width)

        self._each(reqs, begin)

    def _decode(self) -> None:
        self._isolated(sorted(self.running, key=lambda r: r.rows[0]), self._decode_forward, self._advance)

    def _decode_forward(self, reqs: list[TranslationRequest]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        rows, crosses, tokens, positions, spans = [], [], [], [], []
        beam_rows: list[int] = []
        for r in reqs:
            n = len(r.rows)
            spans.append((len(rows), len(rows) + n))
            if r.greedy:
                tokens.append(r.generated[-1] if r.generated else self.cfg.decoder_start_token_id)
                positions.append(len(r.generated))
            else:
                beam_rows += range(len(rows), len(rows) + n)
                tokens += [0] * n  # filled in on the device below
                positions += [r.search.step_index] * n
            rows += r.rows
            crosses += [r.cross_slot] * n
        dev = self.device
        token_ids = torch.tensor(tokens, device=dev)
        if beam_rows:  # the beams' last tokens stay on the device: no copy to the host and back
            token_ids[torch.tensor(beam_rows, device=dev)] = torch.cat([r.search.last_tokens for r in reqs
                                                                       if not r.greedy])
        self.m.batch_size.observe(len(rows))
        if self.graphed is not None:  # the whole static caches, batch padded to a captured bucket
            return self.graphed(token_ids, positions, rows, crosses).float(), spans
        logits = self.model.decode_step(
            token_ids, torch.tensor(positions, device=dev), self.cache,
            torch.tensor(rows, device=dev), torch.tensor(crosses, device=dev),
            kv_len=max(positions) + 1, src_len=max(len(r.job.source_ids) for r in reqs),
        ).float()
        return logits, spans

    def _advance(self, reqs: list[TranslationRequest], output: tuple[torch.Tensor, list[tuple[int, int]]]) -> None:
        """Batched first (all greedy rows in one argmax; beam requests in groups that advance together),
        then each request's own part (text, events) in isolation."""
        logits, spans = output
        now = time.perf_counter()
        span = {id(r): s for r, s in zip(reqs, spans, strict=True)}
        greedy = [r for r in reqs if r.greedy]
        chosen = dict(zip(map(id, greedy), self._greedy_tokens(greedy, logits, span), strict=True))
        groups: dict[tuple, list[TranslationRequest]] = {}
        for r in reqs:
            if not r.greedy:
                groups.setdefault(r.search.group_key(), []).append(r)
        failed: set[int] = set()
        for group in groups.values():
            try:
                self._advance_beams(group, logits, span)
            except Exception as exc:  # their beam states may have moved: these cannot be run again
                failed.update(map(id, group))
                for r in group:
                    self._fail(r, exc)

        def emit(req: TranslationRequest) -> None:
            self.m.generated_tokens.inc()
            if req.greedy:
                self._emit_greedy(req, chosen[id(req)], now)
            elif req.search.done:
                ids = req.search.best()
                finish = "stop" if ids and ids[-1] == self.cfg.eos_token_id else "length"
                self._publish(req, Event(self.tokenizer.decode(ids), ids, finish_reason=finish), now)

        self._each([r for r in reqs if id(r) not in failed], emit)

    def _greedy_tokens(self, reqs: list[TranslationRequest], logits: torch.Tensor,
                       span: dict[int, tuple[int, int]]) -> list[int]:
        if not reqs:
            return []
        g, eos = self.translator.gen, self.cfg.eos_token_id
        scores = logits[torch.tensor([span[id(r)][0] for r in reqs], device=logits.device)]
        scores = ban_tokens(scores, g.banned_token_ids, -1, 0, eos, False)
        last = [i for i, r in enumerate(reqs) if len(r.generated) == r.job.max_new_tokens - 1]
        if g.force_eos_at_max and eos is not None and last:  # only eos may come at the last position
            scores[last] = float("-inf")
            scores[last, eos] = 0.0
        return scores.argmax(dim=-1).tolist()

    def _emit_greedy(self, req: TranslationRequest, token: int, now: float) -> None:
        job, eos = req.job, self.cfg.eos_token_id
        req.generated.append(token)
        finish = None
        if token == eos:
            text, finish = req.detok.flush(), "stop"
        else:
            text = req.detok.push(token)
            if len(req.generated) >= job.max_new_tokens:
                text, finish = text + req.detok.flush(), "length"
        self._publish(req, Event(text, [token], finish_reason=finish), now)

    def _advance_beams(self, group: list[TranslationRequest], logits: torch.Tensor,
                       span: dict[int, tuple[int, int]]) -> None:
        dev = logits.device
        idx = torch.tensor([i for r in group for i in range(*span[id(r)])], device=dev)
        parents = BeamSearch.advance_many([r.search for r in group], torch.log_softmax(logits[idx], dim=-1))
        rows = torch.tensor([r.rows for r in group], device=dev)  # (R, num_beams)
        self.cache.self_kv.copy_slots(rows.gather(1, parents).flatten(), rows.flatten())


def static_decode(model, cache, *, scratch: int, max_batch: int, use_graphs: bool) -> BucketedDecode:  # noqa: ANN001
    """Decoder steps of a `Seq2Seq` over its whole static caches, at bucketed batch sizes. Padding rows use
    self-attention slot and cross slot `scratch`, which no request owns; the scratch source has length 1 so
    that its cross-attention is well defined."""
    cache.cross_kv.lengths[scratch] = 1
    return BucketedDecode(
        lambda tokens, positions, rows, crosses: model.decode_step(tokens, positions, cache, rows, crosses),
        pad_values=(0, 0, scratch, scratch), buckets=default_buckets(max_batch), device=cache.self_kv.k.device,
        use_graphs=use_graphs,
    )
