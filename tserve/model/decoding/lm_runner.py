"""Runs a decoder-only LM for many sequences at once, and `generate`, the one-call way to use it.

The runner owns the paged KV cache, its rows and who holds which block (`model.block_pool`), builds the input tensors of prefill and decode steps (padded to
CUDA-graph buckets on a GPU), chooses every row's next token through the logits pipeline and the sampler,
and applies the finish rules. The serving engine schedules requests onto it; `generate` (warm-up,
evaluation, scripts) runs the very same steps for a list of prompts.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Sequence

import torch
from torch import Tensor

from tserve.model.block_pool import BlockPool, BlockTable
from tserve.model.checkpoint import LoadedModel
from tserve.model.cuda_graphs import BucketedDecode, DecodeAhead, default_buckets
from tserve.model.decoding.chosen_tokens import ChosenTokens, feed_tokens
from tserve.model.decoding.draft_model import DraftModel
from tserve.model.decoding.logits import LogitsPipeline
from tserve.model.decoding.params import SamplingParams
from tserve.model.decoding.sampler import sample, token_logprobs
from tserve.model.decoding.speculative import NgramIndex, Speculation, accept
from tserve.model.decoding.structured import GrammarCompiler, GrammarState, masks_for
from tserve.model.device_inputs import to_device
from tserve.model.kernels.cpu import argmax
from tserve.model.kv_cache import SlotAllocator
from tserve.model.window_blocks import WindowBlocks

StepLogprobs = tuple[list[float], list[list[float]], list[list[int]]]  # chosen, top values, top ids


class TextSequence:
    """One prompt's decoding state."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.slot = -1  # the cache row whose block table it uses while running
        self.table: BlockTable | None = None  # its blocks while admitted
        self.window_table: BlockTable | None = None  # and those of the sliding layers' own pool, if the model has one
        self.num_computed = 0  # positions of `token_ids()` in the cache
        self.cached_tokens = 0  # positions found in the prefix cache at its first admission
        self.pending_names: list[bytes] = []  # names of its prompt blocks it has yet to compute
        self.generated: list[int] = []  # eos excluded
        self.next_token: int | None = None  # chosen, not yet fed to the model
        # Tokens chosen on the device and not yet appended (an engine reads a step's tokens after launching the
        # next), and the step and row the newest of them is fed from.
        self.unresolved = 0
        self.fed_from: tuple[ChosenTokens, int] | None = None
        self.finish_reason: str | None = None  # "stop" | "length"
        # On the model's device, so that sampling needs no copy of the probabilities to the host.
        self.generator = params.make_generator(device)
        self.counts: Tensor | None = None  # made on first use by the penalties, then kept up to date
        # Structured output: this sequence's place in its grammar, and the step's mask of allowed tokens.
        self.grammar: GrammarState | None = params.grammar.matcher() if params.grammar is not None else None
        self.token_mask: Tensor | None = None
        # Speculative decoding: where its n-grams last ended; its draft tokens proposed and kept, in all and
        # since its acceptance was last judged; when it may draft again after a pause.
        self.ngrams: NgramIndex | None = None
        self.drafted = self.accepted = self.recent_drafted = self.recent_accepted = self.resume_at = 0
        # With a draft model: its blocks in the draft cache, on which row, how many of its tokens that cache
        # holds, and this step's draft (fed from position `draft_base`, `draft_len` tokens) until judged.
        self.draft_table: BlockTable | None = None
        self.draft_slot = -1
        self.draft_computed = self.draft_base = self.draft_len = 0

    @property
    def num_generated(self) -> int:
        """Tokens chosen so far, those still on their way from the device too."""
        return len(self.generated) + self.unresolved

    @property
    def has_next(self) -> bool:
        """A token is chosen for the next step to feed (on the host or still on the device)."""
        return self.next_token is not None or self.unresolved > 0

    def token_ids(self) -> list[int]:
        """The tokens fed or to be fed to the model: the prompt, then every generated token (the last one is
        `next_token`, fed at the next step)."""
        return self.prompt_ids + self.generated

    def token_counts(self, vocab_size: int, device: torch.device) -> Tensor:
        if self.counts is None:
            self.counts = torch.zeros(vocab_size, device=device)
            if self.generated:
                self.counts.index_add_(0, torch.tensor(self.generated, device=device),
                                       torch.ones(len(self.generated), device=device))
        return self.counts


def speculation_of(speculation: Speculation | None, draft: LoadedModel | None) -> Speculation | None:
    """The speculation a runner does: as asked, or the default one where a draft model is given."""
    return speculation or (Speculation() if draft is not None else None)


class DecoderRunner:
    def __init__(self, loaded: LoadedModel, *, num_slots: int, max_len: int | None = None, cuda_graphs: bool = True,
                 compile: bool = False, max_grammar_compile_ms: float = 2000.0, num_blocks: int | None = None,
                 block_size: int = 16, prefix_caching: bool = True, speculation: Speculation | None = None,
                 draft: LoadedModel | None = None, window_blocks: int | None = None) -> None:
        """`num_blocks` KV blocks of `block_size` positions are shared by up to `num_slots` running rows (default:
        enough for every row's whole context); `prefix_caching`: sequences share the blocks of a common prefix;
        `speculation`: decode steps may score drafts (`model.decoding.speculative`): prompt-lookup drafts, or
        with `draft` a smaller model's (`model.decoding.draft_model`). A model with sliding-window layers keeps
        theirs in a pool of `window_blocks` blocks of its own (`model.window_blocks`; default
        `WindowBlocks.pool_blocks`; 0: in the one pool, every position kept)."""
        self.speculation = speculation_of(speculation, draft)
        self.model, cfg, gen = loaded.model, loaded.config, loaded.generation
        self.device = loaded.device
        self.vocab_size = cfg.vocab_size
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        tok = loaded.tokenizer
        # The checkpoint's generation eos ids (generation_config.json may list several), else the tokenizer's.
        eos = tok.eos_id if tok is not None and tok.eos_id is not None else cfg.eos_token_id
        self.eos_ids = set(gen.eos_token_ids or ([] if eos is None else [eos]))
        self.pipeline = LogitsPipeline(sorted(self.eos_ids), gen.banned_token_ids, gen.force_eos_at_max)
        self.grammars = GrammarCompiler(tok.backend_json() if tok is not None else None, cfg.vocab_size,
                                        sorted(self.eos_ids), max_grammar_compile_ms)
        # The grammar masks of a step are computed here while the model runs (llguidance releases the GIL).
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        self._masks: tuple[list[TextSequence], concurrent.futures.Future] | None = None
        self.slots = SlotAllocator(num_slots)
        # Names of prompt blocks that admitted sequences have yet to compute: a sequence that would hit the first
        # of them waits a step and reads it, instead of computing it again beside them.
        self._pending: collections.Counter[bytes] = collections.Counter()
        num_blocks = num_blocks or 1 + num_slots * -(-self.max_len // block_size)
        if cfg.sliding_layers and window_blocks is None:
            ahead = self.speculation.num_tokens if self.speculation is not None else 0
            window_blocks = WindowBlocks.pool_blocks(num_slots, self.max_len, cfg.sliding_window, block_size, ahead)
        window_blocks = window_blocks if cfg.sliding_layers else 0
        self.cache = self.model.new_cache(num_slots, self.max_len, num_blocks=num_blocks, block_size=block_size,
                                          window_blocks=window_blocks)
        # The pool is this model's in this dtype: nothing else changes what a block holds.
        salt = f"{cfg.n_layers}/{cfg.kv_heads}/{cfg.d_head}/{self.cache.k.dtype}"
        self.blocks = BlockPool(num_blocks, block_size, prefix_caching=prefix_caching, salt=salt)
        self.windows = WindowBlocks(window_blocks, block_size, cfg.sliding_window, prefix_caching=prefix_caching,
                                    salt=salt) if window_blocks else None
        self.drafter = None if draft is None else DraftModel(
            draft, loaded, num_slots=num_slots, max_len=self.max_len, num_blocks=num_blocks, block_size=block_size,
            max_rows=self.speculation.max_rows, cuda_graphs=cuda_graphs)
        # Mixture-of-experts layers route tokens with data-dependent shapes, which a graph cannot capture.
        graphs = cuda_graphs and self.device.type == "cuda" and not cfg.n_experts
        # Shapes vary only in the batch size (and, on CPU, the attended length): compiled dynamically.
        self._compiled = torch.compile(self.model.decode_step, dynamic=None) if compile else None
        self.graphed: BucketedDecode | None = None
        if graphs:  # padding rows use the cache's spare row (num_slots), whose table is all null blocks
            self.graphed = BucketedDecode(
                lambda tokens, positions, slots: self._decode_step(tokens, positions, self.cache, slots),
                pad_values=(0, 0, num_slots), buckets=default_buckets(num_slots), device=self.device,
                use_graphs=True,
            )
            self.graphed.capture()
        self.graphed_ahead: DecodeAhead | None = None
        if graphs and self.speculation is not None:  # speculative steps: rows padded to 1 + num_tokens positions
            self.graphed_ahead = DecodeAhead(self.model, self.cache, width=1 + self.speculation.num_tokens,
                                             max_rows=min(self.speculation.max_rows, num_slots),
                                             max_positions=cfg.max_seq_len, use_graphs=True)
            self.graphed_ahead.capture()

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError when a prompt cannot run here."""
        if prompt_len == 0:
            raise ValueError("the prompt is empty after tokenization")
        if prompt_len + max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's context of "
                f"{self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        need, have = self.blocks.blocks_for(prompt_len + max_tokens), self.blocks.num_usable
        if self.windows is not None:  # computing a preempted sequence again holds all its blocks there for a while
            have = min(have, self.windows.pool.num_usable)
        if need > have:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV-cache blocks of "
                f"{self.blocks.block_size} positions; the cache has {have} (--kv-cache-memory); lower max_tokens"
            )

    # ----------------------------------------------------------------------------------------------
    # Rows and blocks
    # ----------------------------------------------------------------------------------------------
    def admit(self, seq: TextSequence) -> bool:
        """Give `seq` a row and the blocks for every token it has (its cached prefix shared); False when either
        is short now. A sequence admitted again after preemption recomputes everything it had."""
        ids = seq.token_ids()
        names = self.blocks.prefix_names(ids) if self.blocks.prefix_caching else []
        hits = len(self.blocks.cached_prefix(ids)[0])
        if self.windows is not None:  # as far as the sliding layers still hold the prefix's last window
            hits = self.windows.usable_prefix(names, ids, hits)
        if not self.slots.num_free or not self.blocks.can_admit(ids, most=hits) or \
                (self.windows is not None and not self.windows.can_admit(len(ids), hits)):
            return False
        if names[hits:hits + 1] and names[hits] in self._pending:
            return False  # a sequence admitted before it computes this very block now: wait and read it
        seq.table = self.blocks.admit(ids, most=hits)
        seq.pending_names = names[hits:]
        self._pending.update(seq.pending_names)
        seq.slot = self.slots.allocate(1)[0]
        seq.num_computed = seq.table.num_cached_tokens
        if seq.next_token is None:  # first admission (not a preempted sequence coming back)
            seq.cached_tokens = seq.table.num_cached_tokens
        self.cache.set_table(seq.slot, seq.table.blocks)
        if self.windows is not None:
            seq.window_table = self.windows.admit(ids, names, hits)
            self.cache.local.set_table(seq.slot, seq.window_table.blocks)
        return True

    def grow(self, seq: TextSequence, ahead: int = 0) -> bool:
        """Make room for the position its next decode step writes (and `ahead` draft positions after it); False
        when no block is free."""
        before = len(seq.table.blocks)
        if not self.blocks.grow(seq.table, seq.num_computed + 1 + ahead):
            return False
        if len(seq.table.blocks) != before:
            self.cache.set_table(seq.slot, seq.table.blocks)
        if self.windows is not None:
            before = len(seq.window_table.blocks)
            if not self.windows.grow(seq.window_table, seq.num_computed + 1 + ahead):
                return False
            if len(seq.window_table.blocks) != before:
                self.cache.local.set_table(seq.slot, seq.window_table.blocks)
        return True

    def release(self, seq: TextSequence) -> None:
        """Give back its row and blocks (its named blocks stay findable until their memory is needed)."""
        self._computed_or_dropped(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        if seq.table is not None:
            self.blocks.release(seq.table)
            seq.table, seq.num_computed = None, 0
        if seq.window_table is not None:
            self.windows.release(seq.window_table)
            seq.window_table = None
        if seq.slot >= 0:
            self.slots.free([seq.slot])
            seq.slot = -1

    def _computed_or_dropped(self, seq: TextSequence) -> None:
        """Its prompt blocks are computed (and named) or will never be: no one need wait for them any longer."""
        self._pending.subtract(seq.pending_names)
        for name in seq.pending_names:
            if self._pending[name] <= 0:
                del self._pending[name]
        seq.pending_names = []

    def _computed(self, seqs: Sequence[TextSequence], count: list[int]) -> None:
        """Record that each sequence's first `count` tokens are now in the cache; name its full blocks."""
        bs = self.blocks.block_size
        for s, n in zip(seqs, count, strict=True):
            if n // bs > s.num_computed // bs:
                self.blocks.name_full_blocks(s.table, s.token_ids()[:n])
            s.num_computed = n
            self._window_computed(s)

    def _window_computed(self, seq: TextSequence) -> None:
        """The sliding layers' side of `_computed`: name its full blocks there too, give back what its window left."""
        if self.windows is not None and self.windows.computed(seq.window_table, seq.num_computed,
                                                              lambda: seq.token_ids()[:seq.num_computed]):
            self.cache.local.set_table(seq.slot, seq.window_table.blocks)

    # ----------------------------------------------------------------------------------------------
    # Forward passes
    # ----------------------------------------------------------------------------------------------
    def prefill(self, seqs: Sequence[TextSequence]) -> Tensor:
        """Logits (B, V) of each sequence's last token; writes every token not yet in the cache (the prompt
        past its cached prefix; after a preemption, all it had) into its blocks."""
        self._start_masks(seqs)
        ids = [s.token_ids() for s in seqs]
        start = [s.num_computed for s in seqs]
        lengths = [len(t) - b for t, b in zip(ids, start, strict=True)]
        tokens = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for i, (t, b) in enumerate(zip(ids, start, strict=True)):
            tokens[i, : lengths[i]] = torch.tensor(t[b:])
        dev = self.device
        logits = self.model.prefill(to_device(tokens, dev), to_device(lengths, dev), self.cache,
                                    to_device([s.slot for s in seqs], dev),
                                    to_device(start, dev) if any(start) else None,
                                    kv_len=max(b + n for b, n in zip(start, lengths, strict=True)))
        self._computed(seqs, [len(t) for t in ids])
        for s in seqs:
            self._computed_or_dropped(s)
        return logits

    def decode(self, seqs: Sequence[TextSequence]) -> Tensor:
        """Feeds each sequence's `next_token` (after `grow` made room for it); logits (B, V)."""
        self._start_masks(seqs)
        positions = [s.num_computed for s in seqs]
        rows = [s.slot for s in seqs]  # each sequence's own cache row
        fed = self._fed_tokens(seqs)
        if self.graphed is not None:  # static shapes: every row's whole table, batch padded to a captured bucket
            logits = self.graphed(fed, positions, rows)
        elif self._compiled is None and self.device.type == "cpu":
            # Eager on the CPU: host ints as they are (a fused step reads them with no tensor built); attend only
            # over the positions in use, which is where a CPU spends its time.
            logits = self.model.decode_step(fed, positions, self.cache, rows, kv_len=max(positions) + 1)
        else:
            dev = self.device
            logits = self._decode_step(fed if isinstance(fed, Tensor) else to_device(fed, dev),
                                       to_device(positions, dev), self.cache, to_device(rows, dev),
                                       kv_len=max(positions) + 1)
        self._computed(seqs, [p + 1 for p in positions])
        return logits

    def _fed_tokens(self, seqs: Sequence[TextSequence]) -> list[int] | Tensor:
        """The tokens a decode step feeds: host ints, or, where some were chosen by a step whose tokens the host
        has not read yet, a device tensor with those taken from that step's output (no host sync)."""
        if not any(s.unresolved for s in seqs):
            return [s.next_token for s in seqs]
        return feed_tokens([0 if s.unresolved else s.next_token for s in seqs],
                           [(i, *s.fed_from) for i, s in enumerate(seqs) if s.unresolved], self.device)

    # ----------------------------------------------------------------------------------------------
    # Speculative steps
    # ----------------------------------------------------------------------------------------------
    def drafts(self, seqs: Sequence[TextSequence]) -> list[list[int]]:
        """Each sequence's draft for this step, prompt-lookup or the draft model's ([] where it drafts nothing:
        speculation off or too many rows, a grammar or penalties, a pause after low acceptance, no n-gram found,
        no room left). A step's padding runs to its longest draft, so every draft is cut to what the row nearest
        its context end holds."""
        spec = self.speculation
        if spec is None or len(seqs) > spec.max_rows:
            return [[] for _ in seqs]
        rooms = [min(spec.num_tokens, s.params.max_tokens - s.num_generated - 1, self.max_len - 1 - s.num_computed)
                 for s in seqs]
        rooms = [room if room > 0 and spec.drafting(s) else 0 for s, room in zip(seqs, rooms, strict=True)]
        if self.drafter is not None:
            out = self.drafter.draft(seqs, rooms)
        else:
            out = []
            for s, room in zip(seqs, rooms, strict=True):
                if s.ngrams is None and room:
                    s.ngrams = NgramIndex(spec.min_ngram, spec.max_ngram)
                out.append(s.ngrams.draft(s.token_ids(), room) if room else [])
        width = min([max(map(len, out))] + [self.max_len - 1 - s.num_computed for s in seqs])
        return [d[:width] for d in out]

    def decode_ahead(self, seqs: Sequence[TextSequence], drafts: Sequence[list[int]]) -> Tensor:
        """Feeds each sequence's `next_token` and its draft (after `grow(seq, len(draft))`); logits (B, T, V),
        T = 1 + the longest draft. On CUDA with graphs, at the captured width and batch bucket (`DecodeAhead`)."""
        self._start_masks(seqs)
        fed, starts = [[s.next_token, *d] for s, d in zip(seqs, drafts, strict=True)], [s.num_computed for s in seqs]
        if self.graphed_ahead is not None and self.graphed_ahead.fits(starts, [len(f) for f in fed]):
            return self.graphed_ahead(fed, starts, [s.slot for s in seqs])
        width = max(map(len, fed))  # eager: padded to the longest draft only
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, f in enumerate(fed):
            tokens[i, : len(f)] = torch.tensor(f)
        positions = torch.tensor(starts)[:, None] + torch.arange(width)
        dev = self.device
        return self.model.decode_tokens(tokens.to(dev), positions.to(dev), self.cache,
                                        torch.tensor([s.slot for s in seqs], device=dev),
                                        kv_len=int(positions.max()) + 1)

    def choose_ahead(self, seqs: Sequence[TextSequence], drafts: Sequence[list[int]], logits: Tensor,
                     ) -> tuple[list[list[int]], StepLogprobs | None, list[list[int]]]:
        """Each sequence's tokens from a speculative step (its kept draft, then one of the model's), the
        logprobs of every scored position (None unless asked), and per sequence the positions (into those)
        of its tokens. Records what each kept: its cache now holds its next token and its kept draft."""
        self._attach_masks(seqs)
        tokens, constrained, chosen, where = accept(self.pipeline, seqs, drafts, logits)
        bs = self.blocks.block_size
        for s, d, t in zip(seqs, drafts, tokens, strict=True):
            kept = len(t) - 1
            s.drafted, s.accepted = s.drafted + len(d), s.accepted + kept
            s.recent_drafted, s.recent_accepted = s.recent_drafted + len(d), s.recent_accepted + kept
            if self.drafter is not None:
                self.drafter.kept(s, kept)
            n = s.num_computed + 1 + kept
            if n // bs > s.num_computed // bs:
                self.blocks.name_full_blocks(s.table, (s.token_ids() + d[:kept])[:n])
            s.num_computed = n
            self._window_computed(s)
        logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            n_top = max(s.params.logprobs or 0 for s in seqs)
            chosen_lp, top_v, top_i = (x.tolist() for x in token_logprobs(constrained, chosen, n_top))
            logprobs = (chosen_lp, top_v, top_i)
        return tokens, logprobs, where

    def _start_masks(self, seqs: Sequence[TextSequence]) -> None:
        """Begin the grammar masks of this step's constrained rows, beside the forward pass."""
        guided = [s for s in seqs if s.grammar is not None]
        self._masks = None
        if guided:
            self._masks = (guided, self._mask_pool.submit(masks_for, [s.grammar for s in guided], self.vocab_size))

    def _attach_masks(self, seqs: Sequence[TextSequence]) -> None:
        """Give each constrained row its mask for this step (computed beside the forward pass when the same
        rows went through it, here otherwise)."""
        guided = [s for s in seqs if s.grammar is not None]
        for s in seqs:
            s.token_mask = None
        if not guided:
            return
        pending, self._masks = self._masks, None
        if pending is not None and len(pending[0]) == len(guided) and all(
                a is b for a, b in zip(pending[0], guided, strict=True)):
            bitmask = pending[1].result()
        else:
            bitmask = masks_for([s.grammar for s in guided], self.vocab_size)
        for s, row in zip(guided, bitmask, strict=True):
            s.token_mask = row

    def _decode_step(self, *args, **kwargs) -> Tensor:  # noqa: ANN002, ANN003
        return (self._compiled or self.model.decode_step)(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # Next tokens
    # ----------------------------------------------------------------------------------------------
    def choose(self, seqs: Sequence[TextSequence], logits: Tensor) -> tuple[list[int], StepLogprobs | None]:
        """Every row's next token (one host sync), and the log-probabilities of the rows that asked for
        them (over the constrained scores, before temperature)."""
        return self.resolve(self.choose_later(seqs, logits))

    def choose_later(self, seqs: Sequence[TextSequence], logits: Tensor) -> ChosenTokens:
        """`choose` without waiting for the device: the tokens stay there (a next `decode` feeds them) until
        `resolve`. Rows whose choice depends on their tokens so far (penalties, a grammar) must be resolved
        before their next step is chosen (`needs_tokens`). `logits` are handed over: bans are written into them."""
        params = [s.params for s in seqs]
        self._attach_masks(seqs)
        if all(p.greedy and p.logprobs is None for p in params) and \
                (excluded := self.pipeline.exclusions(seqs)) is not None:
            # Greedy rows whose constraints only rule ids out: the bans and the argmax in one call.
            return ChosenTokens(seqs, argmax(logits, excluded), None)
        constrained = self.pipeline.constrain(logits, seqs, owned=True)
        tokens = sample(self.pipeline.shape(constrained, seqs), params,
                        [s.generator for s in seqs])
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = token_logprobs(constrained, tokens, max(p.logprobs or 0 for p in params))
        return ChosenTokens(seqs, tokens, logprobs)

    @staticmethod
    def resolve(chosen: ChosenTokens) -> tuple[list[int], StepLogprobs | None]:
        """A step's tokens and logprobs on the host (waiting for the device if it is still at it)."""
        return chosen.read()

    @staticmethod
    def needs_tokens(seq: TextSequence) -> bool:
        """Its next step's choice reads the tokens it has (penalty counts, a grammar's state): a step may not
        be chosen for it while one of its tokens is still on the device."""
        return seq.params.penalized or seq.grammar is not None

    def ends_by_length(self, seq: TextSequence) -> bool:
        """Its unresolved tokens bring it to max_tokens or the context's end: no step follows them."""
        n = len(seq.generated) + seq.unresolved
        return seq.unresolved > 0 and (n >= seq.params.max_tokens or len(seq.prompt_ids) + n >= self.max_len)

    def append(self, seq: TextSequence, token: int) -> str | None:
        """Record a chosen token; returns the finish reason when the sequence ends with it. Eos (unless
        ignored) ends it and is not part of the output; so do max_tokens and the context limit."""
        seq.next_token = token
        if token in self.eos_ids and not seq.params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            seq.generated.append(token)
            known = min(seq.num_computed, len(seq.prompt_ids) + len(seq.generated))
            if seq.table is not None and known // self.blocks.block_size > len(seq.table.hashes) and \
                    self.blocks.prefix_caching:
                # a step fed it from the device before its tokens were known: name the blocks they filled
                self.blocks.name_full_blocks(seq.table, seq.token_ids()[:known])
                if self.windows is not None:
                    self.windows.pool.name_full_blocks(seq.window_table, seq.token_ids()[:known])
            if seq.counts is not None:
                seq.counts[token] += 1
            if seq.grammar is not None:
                seq.grammar.advance(token)
            if seq.grammar is not None and seq.grammar.finished:  # complete: nothing more may follow
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.params.max_tokens or len(seq.prompt_ids) + len(seq.generated) >= self.max_len:
                seq.finish_reason = "length"
        return seq.finish_reason


@torch.inference_mode()
def generate(loaded: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             *, runner: DecoderRunner | None = None, max_batch: int = 32) -> list[TextSequence]:
    """Decode every prompt (token ids) to its end, up to `max_batch` (or the runner's free rows and blocks) at a
    time (a prompt whose prefix another one of the batch computes waits for the next batch and reads it).
    Each result's `generated` holds its tokens (eos excluded) and `finish_reason` why it ended."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if runner is None:
        runner = DecoderRunner(loaded, num_slots=max(1, min(max_batch, len(prompts))), cuda_graphs=False)
    seqs = [TextSequence(p, sp, runner.device) for p, sp in zip(prompts, params, strict=True)]
    for s in seqs:
        runner.check(len(s.prompt_ids), s.params.max_tokens)
    waiting = list(seqs)
    while waiting:
        batch = []
        while waiting and len(batch) < max_batch and runner.admit(waiting[0]):  # those that fit now, in order
            batch.append(waiting.pop(0))
        if not batch:
            raise RuntimeError("the KV cache has too few free blocks for this prompt")
        try:
            running, logits = batch, runner.prefill(batch)
            steps = [[t] for t in runner.choose(running, logits)[0]]
            while running:
                running = [s for s, tokens in zip(running, steps, strict=True) if _append_all(runner, s, tokens)]
                if not running:
                    break
                drafts = runner.drafts(running)
                for s, d in zip(running, drafts, strict=True):
                    if not runner.grow(s, len(d)):
                        raise RuntimeError("the KV cache ran out of blocks; lower max_batch")
                if any(drafts):
                    steps = runner.choose_ahead(running, drafts, runner.decode_ahead(running, drafts))[0]
                else:
                    steps = [[t] for t in runner.choose(running, runner.decode(running))[0]]
        finally:
            for s in batch:
                runner.release(s)
    return seqs


def _append_all(runner: DecoderRunner, seq: TextSequence, tokens: list[int]) -> bool:
    """Append a step's tokens until the sequence finishes; whether it goes on."""
    return all(runner.append(seq, t) is None for t in tokens)
