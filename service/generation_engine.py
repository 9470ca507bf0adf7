"""Continuous batching for a causal language model: one KV-cache slot per request, every running request
advances by one token per step, each sampled with its own parameters and generator, so a request's output
does not depend on its neighbours."""

from __future__ import annotations

import time

import torch

from model.checkpoint import LoadedModel
from model.cuda_graphs import BucketedDecode, default_buckets
from model.generation import SamplingParams, StopStrings, apply_penalties, sample, token_logprobs
from model.kv_cache import SlotAllocator
from model.tokenizer import IncrementalDetokenizer
from service.engine import EngineRequest, Event, StepEngine, TokenLogprob
from service.metrics import Metrics


class GenerationRequest(EngineRequest):
    def __init__(self, prompt_ids: list[int], params: SamplingParams, deadline: float,
                 detokenizer: IncrementalDetokenizer, device: torch.device | str = "cpu") -> None:
        super().__init__(deadline)
        self.prompt_ids = prompt_ids
        self.params = params
        self.slot = -1
        self.generated: list[int] = []
        self.next_token: int | None = None  # sampled, not yet fed to the model
        # On the model's device, so that sampling needs no copy of the probabilities to the host.
        self.generator = None if params.greedy else params.make_generator(device)
        self.counts: torch.Tensor | None = None
        self.detok = detokenizer
        self.stops = StopStrings(params.stop)


class GenerationEngine(StepEngine):
    def __init__(self, name: str, loaded: LoadedModel, *, max_slots: int, max_queue: int,
                 max_model_len: int | None, timeout_s: float, metrics: Metrics, cuda_graphs: bool = True,
                 compile: bool = False) -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_slots)
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.max_len = min(max_model_len or loaded.config.max_seq_len, loaded.config.max_seq_len)
        self.eos = loaded.tokenizer.eos_id if loaded.tokenizer.eos_id is not None else loaded.config.eos_token_id
        self.device = loaded.device
        self.slots = SlotAllocator(max_slots)
        self.graphed: BucketedDecode | None = None
        # Mixture-of-experts layers route tokens with data-dependent shapes, which a graph cannot capture.
        graphs = cuda_graphs and self.device.type == "cuda" and not loaded.config.n_experts
        # With graphs, one extra cache slot, owned by no request, takes the rows that pad a batch to its bucket.
        self.cache = self.model.new_cache(max_slots + 1 if graphs else max_slots, self.max_len)
        # Shapes vary only in the batch size (and, on CPU, the attended length): compiled dynamically.
        self._compiled = torch.compile(self.model.decode_step, dynamic=None) if compile else None
        if graphs:
            self.graphed = BucketedDecode(
                lambda tokens, positions, slots: self._decode_step(tokens, positions, self.cache, slots),
                pad_values=(0, 0, max_slots), buckets=default_buckets(max_slots), device=self.device,
                use_graphs=True,
            )
            self.graphed.capture()

    # ----------------------------------------------------------------------------------------------
    # Event-loop side
    # ----------------------------------------------------------------------------------------------
    def check_limits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty after tokenization")
        if prompt_len + max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's context of "
                f"{self.max_len} tokens; shorten the prompt or lower max_tokens"
            )

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> GenerationRequest:
        """Queue a request (raises QueueFull or ValueError). Must be called on the event loop."""
        self.check_limits(len(prompt_ids), params.max_tokens)
        req = GenerationRequest(prompt_ids, params, time.perf_counter() + self.timeout_s,
                                IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids), self.device)
        self._enqueue(req)
        return req

    def submit_job(self, job: tuple[list[int], SamplingParams]) -> GenerationRequest:
        return self.submit(*job)

    @property
    def slots_in_use(self) -> int:
        return self.slots.num_used

    @torch.inference_mode()
    def score_prompt(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Log-probabilities of each prompt token given the ones before it (for `echo` with `logprobs`).
        The first token has none. Pure forward pass without the cache, so it can run beside the engine."""
        tokens = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(tokens)[0, :-1].float()
        chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, tokens[0, 1:], k))
        out: list[TokenLogprob | None] = [None]
        for tok, c, tv, ti in zip(prompt_ids[1:], chosen, top_v, top_i, strict=True):
            top = dict(zip(self.tokenizer.tokens(ti), tv, strict=True))
            out.append(TokenLogprob(self.tokenizer.tokens([tok])[0], c, top))
        return out

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        return self.slots.num_used

    def _reserve(self, req: GenerationRequest) -> bool:
        if not self.slots.num_free:
            return False
        req.slot = self.slots.allocate(1)[0]
        return True

    def _release(self, req: GenerationRequest) -> None:
        if req.slot >= 0:
            self.slots.free([req.slot])
            req.slot = -1

    def _prefill(self, reqs: list[GenerationRequest]) -> None:
        self._isolated(reqs, self._prefill_forward, self._sample_and_emit)

    def _decode(self) -> None:
        # In slot order: consecutive slots let the model read the cache through a view instead of a gather.
        reqs = sorted((r for r in self.running if r.next_token is not None), key=lambda r: r.slot)
        if reqs:
            self._isolated(reqs, self._decode_forward, self._sample_and_emit)

    def _prefill_forward(self, reqs: list[GenerationRequest]) -> torch.Tensor:
        lengths = [len(r.prompt_ids) for r in reqs]
        tokens = torch.zeros(len(reqs), max(lengths), dtype=torch.long)
        for i, r in enumerate(reqs):
            tokens[i, : lengths[i]] = torch.tensor(r.prompt_ids)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits = self.model.prefill(tokens.to(self.device), torch.tensor(lengths, device=self.device),
                                    self.cache, slots)
        self.m.batch_size.observe(len(reqs))
        return logits

    def _decode_step(self, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        return (self._compiled or self.model.decode_step)(*args, **kwargs)

    def _decode_forward(self, reqs: list[GenerationRequest]) -> torch.Tensor:
        positions = [len(r.prompt_ids) + len(r.generated) - 1 for r in reqs]
        self.m.batch_size.observe(len(reqs))
        if self.graphed is not None:  # static shapes: the whole cache, batch padded to a captured bucket
            return self.graphed([r.next_token for r in reqs], positions, [r.slot for r in reqs])
        dev = self.device
        # Eager (CPU): attend only over the positions in use, which is where a CPU spends its time.
        return self._decode_step(
            torch.tensor([r.next_token for r in reqs], device=dev), torch.tensor(positions, device=dev),
            self.cache, torch.tensor([r.slot for r in reqs], device=dev), kv_len=max(positions) + 1,
        )

    def _sample_and_emit(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> None:
        logits = logits.float()
        dev = logits.device
        params = [r.params for r in reqs]
        if any(p.penalized for p in params):
            counts = torch.stack([self._counts(r) for r in reqs])
            logits = apply_penalties(logits, counts, torch.tensor([p.presence_penalty for p in params], device=dev),
                                     torch.tensor([p.frequency_penalty for p in params], device=dev))
        if self.eos is not None:
            ban = [i for i, r in enumerate(reqs) if r.params.ignore_eos or len(r.generated) < r.params.min_tokens]
            if ban:
                logits[ban, self.eos] = float("-inf")
        if all(p.greedy for p in params):  # no per-row parameter tensors to build and copy
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample(
                logits,
                torch.tensor([p.temperature for p in params], device=dev),
                torch.tensor([max(p.top_k, 0) for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                [r.generator for r in reqs],
            )
        n_top = max((p.logprobs or 0) for p in params)
        want_logprobs = any(p.logprobs is not None for p in params)
        if want_logprobs:
            chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, tokens, n_top))
        now = time.perf_counter()
        row = {id(r): i for i, r in enumerate(reqs)}
        sampled = tokens.tolist()

        def emit(req: GenerationRequest) -> None:
            i, token = row[id(req)], sampled[row[id(req)]]
            lp = None
            if want_logprobs and req.params.logprobs is not None:
                k = req.params.logprobs
                top = {self.tokenizer.tokens([t])[0]: v for t, v in zip(top_i[i][:k], top_v[i][:k], strict=True)}
                lp = TokenLogprob(self.tokenizer.tokens([token])[0], chosen[i], top)
            self._append(req, token, lp, now)

        self._each(reqs, emit)

    def _counts(self, req: GenerationRequest) -> torch.Tensor:
        if req.counts is None:
            req.counts = torch.zeros(self.model.cfg.vocab_size, device=self.device)
            for t in req.generated:
                req.counts[t] += 1
        return req.counts

    def _append(self, req: GenerationRequest, token: int, lp: TokenLogprob | None, now: float) -> None:
        p = req.params
        is_eos = token == self.eos and not p.ignore_eos
        finish = None
        if is_eos:
            text, finish = req.stops.flush() + req.detok.flush(), "stop"
        else:
            req.generated.append(token)
            if req.counts is not None:
                req.counts[token] += 1
            text, stopped = req.stops.feed(req.detok.push(token))
            if stopped:
                finish = "stop"
            elif len(req.generated) >= p.max_tokens or len(req.prompt_ids) + len(req.generated) >= self.max_len:
                text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
                finish = "length"
        self.m.generated_tokens.inc()
        req.next_token = token
        event = Event(text, [] if is_eos else [token], [lp] if lp is not None and not is_eos else [], finish)
        self._publish(req, event, now)
