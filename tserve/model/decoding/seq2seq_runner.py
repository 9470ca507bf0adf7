"""Runs an encoder-decoder translator for many requests at once, beam search included, and `translate`,
the one-call way to use it.

A request is started by running its encoder (batched with the other starts) and writing its cross-attention
keys/values once into the blocks of a cross slot. Every decoder step then advances all running requests
together: a greedy request is one row of the batch, a beam request `num_beams` rows. A row's self-attention keys/values
live in the blocks of its table (`model.block_pool`); when beams are reordered by parent, a beam that takes
over another parent's cache forks the parent's table: the full blocks are shared and only the last, partial
block is copied (copy-on-write). Every row's scores go through the logits pipeline; beam search is the
one-request `BeamSearch` fed with this request's rows, so its result does not depend on what else runs.

Decoder rows and encoded sources draw blocks from one pool, which may be smaller than every row's and every
source's whole length (`num_blocks`). A request is then admitted with the blocks of its source and of its first
position and grows a block at a time. When the pool runs dry, encoder outputs kept for reuse that no running
request reads give their blocks up first (unread the longest first); then a request may be preempted (`preempt`):
its blocks and rows go back, its decoding state (greedy tokens, beams) stays. Admitted again, it first
replays: one position per step, each row is fed the token it had at that position and its logits are
dropped, until its cache holds what it held; then it goes on where it stopped, with nothing emitted twice.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tserve.model.block_pool import BlockPool, BlockTable
from tserve.model.checkpoint import LoadedModel
from tserve.model.cuda_graphs import BucketedDecode, default_buckets
from tserve.model.decoding.beam_search import BeamSearch, BeamSettings
from tserve.model.decoding.chosen_tokens import ChosenTokens, feed_tokens
from tserve.model.decoding.constrained_beam import ConstrainedBeamSearch, ConstraintsUnmet
from tserve.model.decoding.logits import LogitsPipeline
from tserve.model.decoding.params import SamplingParams
from tserve.model.decoding.top_tokens import advance_beams, greedy_tokens
from tserve.model.device_inputs import to_device
from tserve.model.kv_cache import SlotAllocator
from tserve.model.tokenizer import Tokenizer

Spans = list[tuple[int, int]]  # each request's rows in the decoder batch
REPLAYED = -1  # `advance`'s token for a request that recomputed a position of its cache this step


@dataclass
class TranslationJob:
    source_ids: list[int]
    num_beams: int
    max_new_tokens: int
    # Hard lexical constraints (glossary terms): token ids that must appear in the output, and their text.
    constraints: list[list[int]] = field(default_factory=list)
    constraint_terms: list[str] = field(default_factory=list)
    # Multilingual translators: the target language's code, the decoder's forced first token.
    forced_first_token: int | None = None


def source_key(job: TranslationJob) -> tuple[int, ...]:
    """What an encoder output depends on: the source's ids (a multilingual source's language code among them)."""
    return tuple(job.source_ids)


def translation_job(loaded: LoadedModel, source_ids: Sequence[int], num_beams: int | None = None,
                    max_new_tokens: int | None = None, forced_first_token: int | None = None) -> TranslationJob:
    """A job with the checkpoint's defaults where the caller gives none."""
    g, cfg = loaded.generation, loaded.config
    return TranslationJob(list(source_ids), num_beams or g.num_beams,
                          max_new_tokens or min(g.max_new_tokens, cfg.max_target_len),
                          forced_first_token=forced_first_token)


class TranslationSequence:
    """One source's decoding state."""

    def __init__(self, job: TranslationJob) -> None:
        self.job = job
        self.params = SamplingParams(max_tokens=job.max_new_tokens, temperature=0.0)
        self.rows: list[int] = []  # self-attention cache rows: 1 (greedy) or num_beams
        self.cross_slot = -1
        self.encoded = False  # its cross slot holds its encoder output (written now, or by an identical source)
        self.search: BeamSearch | ConstrainedBeamSearch | None = None
        self.generated: list[int] = []  # greedy output so far (eos included once reached)
        self.logprob_sum = 0.0  # greedy: the model's log-probability of `generated`
        self.finish_reason: str | None = None
        self.resume_at = 0  # after a preemption: the positions its cache must hold again before it goes on
        self.replayed = 0  # of those, recomputed so far
        # Greedy tokens chosen on the device, not yet appended (an engine reads a step's tokens after launching
        # the next), and the step and row the newest of them is fed from (`ChosenTokens`).
        self.unresolved = 0
        self.fed_from: tuple[ChosenTokens, int] | None = None

    @property
    def replaying(self) -> bool:
        return self.replayed < self.resume_at

    @property
    def next_position(self) -> int:
        """The decoder position of the tokens the next step feeds (0: the decoder start token)."""
        return len(self.generated) + self.unresolved if self.greedy else self.search.step_index

    @property
    def step_position(self) -> int:
        """The position the next step writes: a replayed one, or `next_position`."""
        return self.replayed if self.replaying else self.next_position

    @property
    def greedy(self) -> bool:
        return self.job.num_beams == 1

    @property
    def forced_first_token(self) -> int | None:
        return self.job.forced_first_token

    @property
    def num_generated(self) -> int:
        return len(self.generated) + self.unresolved if self.greedy else self.search.step_index

    def token_counts(self, vocab_size: int, device: torch.device) -> Tensor:
        return torch.zeros(vocab_size, device=device).index_add_(
            0, torch.tensor(self.generated, dtype=torch.long, device=device), torch.ones(len(self.generated),
                                                                                        device=device))

    def batch_places(self) -> list[int]:
        """Each beam's place among this sequence's rows in a decoder batch, which lists them by slot (so that
        consecutive slots are read through a view) while `rows[j]` is beam j's row."""
        by_slot = sorted(self.rows)
        return [by_slot.index(r) for r in self.rows]

    @property
    def output_ids(self) -> list[int]:
        """The translation's ids so far (the best hypothesis once a beam search is done); eos included."""
        return self.generated if self.greedy else self.search.best()


class Seq2SeqRunner:
    def __init__(self, loaded: LoadedModel, *, num_rows: int, cuda_graphs: bool = True,
                 max_len: int | None = None, block_size: int = 16, reuse_sources: bool = True,
                 num_blocks: int | None = None) -> None:
        """`max_len`: the most source tokens, and target positions, a row's cache holds (default: the model's
        own limits, which for a 1024-position model with many rows is gigabytes). `reuse_sources`: a source
        identical to one encoded before reads that encoder output (its cross slot) instead of encoding again.
        `num_blocks`: the block pool of decoder rows and encoded sources, the null block included (default: every
        row's whole target length and as many whole sources, so that nothing is ever preempted)."""
        self.model, self.cfg, self.gen = loaded.model, loaded.config, loaded.generation
        self.max_source_len = min(self.cfg.max_source_len, max_len or self.cfg.max_source_len)
        self.max_target_len = min(self.cfg.max_target_len, max_len or self.cfg.max_target_len)
        self.device = loaded.device
        self.eos = self.cfg.eos_token_id
        self.pipeline = LogitsPipeline(self.eos, self.gen.banned_token_ids, self.gen.force_eos_at_max)
        self.rows = SlotAllocator(num_rows)
        self.cross_slots = SlotAllocator(num_rows)
        # Encoder outputs kept for reuse: the source each encoded slot holds, how many running requests read it,
        # and the slots none reads (still findable, taken for a new source oldest first when no slot is free).
        self.reuse_sources = reuse_sources
        self._slot_of_source: dict[tuple[int, ...], int] = {}
        self._source_of_slot: dict[int, tuple[int, ...]] = {}
        self._readers: collections.Counter[int] = collections.Counter()
        self._idle_slots: collections.OrderedDict[int, None] = collections.OrderedDict()
        if num_blocks is None:  # every row's whole length: a translation never waits for blocks once admitted
            num_blocks = 1 + num_rows * row_blocks(self.max_source_len, self.max_target_len, block_size)
        self.blocks = BlockPool(num_blocks, block_size, prefix_caching=False)
        self.tables: dict[int, BlockTable] = {}  # cache row -> its blocks
        self.source_tables: dict[int, BlockTable] = {}  # cross slot -> the blocks of its encoder output
        # Hypothesis buffers as wide as the longest possible output, so that any beam requests can be stacked.
        self.width = self.max_target_len + 1
        lengths = dict(max_target_len=self.max_target_len, max_source_len=self.max_source_len,
                       num_blocks=num_blocks, block_size=block_size)
        self.graphed: BucketedDecode | None = None
        if cuda_graphs and self.device.type == "cuda" and not self.cfg.n_experts:  # MoE routing: dynamic shapes
            self.cache = self.model.new_cache(num_rows, num_rows + 1, **lengths)  # the padding row: the spare table
            self.graphed = static_decode(self.model, self.cache, scratch=num_rows, max_batch=num_rows,
                                         use_graphs=True)
            self.graphed.capture()
        else:
            self.cache = self.model.new_cache(num_rows, num_rows, **lengths)

    def beam_settings(self, job: TranslationJob) -> BeamSettings:
        g = self.gen
        return BeamSettings(num_beams=job.num_beams, max_new_tokens=job.max_new_tokens, eos_token_id=self.eos,
                            length_penalty=g.length_penalty, early_stopping=g.early_stopping)

    def final_hypotheses(self, seq: TranslationSequence,
                         tokenizer: Tokenizer) -> list[tuple[str, list[int], float]] | ConstraintsUnmet:
        """A finished sequence's translations as (text, ids, score), distinct by text, in the order beam search
        ranks them (the first is what `transformers`' `generate` and CTranslate2 return), or the
        ConstraintsUnmet it ends with. The score is the one beam search ranks by, of the ids generated (with
        `output_scores`, `transformers` calls it `sequences_scores`). A beam may spell a text with other tokens
        than the text encodes to ("Druck" + "er." for "Drucker" + "."); teacher forcing the text's own tokens
        may then give another score, which neither ranks nor is reported. Of hypotheses with the same text,
        the first ranked stays."""
        best: dict[str, tuple[list[int], float]] = {}
        for ids, score in self.hypotheses(seq):
            text = tokenizer.decode(ids)
            if all(term in text for term in seq.job.constraint_terms):  # else the terms' tokens are not verbatim
                best.setdefault(text, (ids, score))
        if not best:
            return ConstraintsUnmet(seq.job.constraint_terms)
        return [(text, ids, score) for text, (ids, score) in best.items()]

    def hypotheses(self, seq: TranslationSequence) -> list[tuple[list[int], float]]:
        """A finished sequence's hypotheses, best first, with the score beam search ranks by: the sum of the
        model's log-probabilities of the generated ids (eos included) over their number ** length_penalty.
        Greedy: its one output, scored the same way."""
        if not seq.greedy:
            return seq.search.hypotheses(seq.job.num_beams)
        return [(seq.generated, seq.logprob_sum / max(len(seq.generated), 1) ** self.gen.length_penalty)]

    # ----------------------------------------------------------------------------------------------
    # Rows
    # ----------------------------------------------------------------------------------------------
    def blocks_needed(self, job: TranslationJob) -> int:
        """The blocks a request holds at its longest (its source's, and each row the positions it feeds: the start
        token and every output token but the last): more than the pool has, and it could never finish."""
        return self.blocks.blocks_for(len(job.source_ids)) + job.num_beams * self.blocks.blocks_for(job.max_new_tokens)

    def blocks_for_next_step(self, seqs: Sequence[TranslationSequence]) -> int:
        """The blocks `seqs` take at their next step: one for each row whose next position starts a block."""
        bs = self.blocks.block_size
        return sum(len(s.rows) for s in seqs if s.rows and len(self.tables[s.rows[0]].blocks) * bs <= s.step_position)

    def reserve(self, seq: TranslationSequence, spare: int = 0) -> bool:
        """Claim the decoder rows, the blocks of their first position (a preempted sequence: of every position
        it replays) and the cross slot `seq` needs with its source's blocks (or the slot of an identical source
        encoded before, if any: `seq.encoded` is then already True), leaving `spare` blocks free (those the
        running requests take at their next step, which would otherwise preempt the request just admitted);
        False when they are not free now, even with the encoder outputs no running request reads given up."""
        if len(seq.job.source_ids) > self.max_source_len:  # (before anything is claimed)
            raise ValueError(f"a source of {len(seq.job.source_ids)} tokens; this runner holds {self.max_source_len}")
        positions = seq.resume_at + 1
        if self.rows.num_free < seq.job.num_beams:
            return False
        slot = self._slot_of_source.get(source_key(seq.job)) if self.reuse_sources else None
        need = seq.job.num_beams * self.blocks.blocks_for(positions) + spare
        if slot is None:
            if not self.cross_slots.num_free and not self._idle_slots:
                return False
            need += self.blocks.blocks_for(len(seq.job.source_ids))
        if not self._free_blocks(need, keep=slot):
            return False
        if slot is not None:
            self._idle_slots.pop(slot, None)
        else:
            if not self.cross_slots.num_free:  # the encoder output unread the longest gives way
                self._forget_source(next(iter(self._idle_slots)))
            slot = self.cross_slots.allocate(1)[0]
            self.source_tables[slot] = table = BlockTable()
            self.blocks.grow(table, len(seq.job.source_ids))
            self.cache.cross_kv.set_table(slot, table.blocks)
        seq.encoded = slot in self._source_of_slot
        self._readers[slot] += 1
        seq.rows = self.rows.allocate(seq.job.num_beams)
        seq.cross_slot = slot
        seq.replayed = 0
        for row in seq.rows:
            self.tables[row] = BlockTable()
            self.blocks.grow(self.tables[row], positions)
        self.cache.self_kv.set_tables(seq.rows, [self.tables[row].blocks for row in seq.rows])
        return True

    def _free_blocks(self, n: int, keep: int | None = None) -> bool:
        """At least `n` free blocks, giving up encoder outputs that no running request reads (unread the longest
        first; not `keep`'s) where needed; False, and nothing given up, when even that is too few."""
        if self.blocks.num_free >= n:
            return True
        kept = self.blocks_kept - (len(self.source_tables[keep].blocks) if keep in self._idle_slots else 0)
        if self.blocks.num_free + kept < n:
            return False
        for slot in [slot for slot in self._idle_slots if slot != keep]:
            if self.blocks.num_free >= n:
                break
            self._forget_source(slot)
        return True

    def _forget_source(self, slot: int) -> None:
        """An encoder output no running request reads goes: its blocks and its slot are free again."""
        del self._idle_slots[slot]
        del self._slot_of_source[self._source_of_slot.pop(slot)]
        self.blocks.release(self.source_tables.pop(slot))
        self.cross_slots.free([slot])

    @property
    def blocks_kept(self) -> int:
        """Blocks of encoder outputs kept for reuse that no running request reads (given up when needed)."""
        return sum(len(self.source_tables[slot].blocks) for slot in self._idle_slots)

    @property
    def blocks_in_use(self) -> int:
        """Blocks the running requests hold: their rows' and the sources they read."""
        return self.blocks.num_in_use - self.blocks_kept

    @property
    def cross_slots_held(self) -> int:
        """Cross slots a running request reads (encoder outputs kept for reuse and read by none not counted)."""
        return len(self._readers)

    def grow(self, seq: TranslationSequence) -> bool:
        """Room in every row of `seq` for the position its next step writes; False when the pool is dry even
        with the encoder outputs no running request reads given up (the blocks found so far stay with their
        rows)."""
        grown: list[int] = []
        ok = self._grow_rows(seq, grown)
        self.cache.self_kv.set_tables(grown, [self.tables[row].blocks for row in grown])
        return ok

    def _grow_rows(self, seq: TranslationSequence, grown: list[int]) -> bool:
        """`grow` without telling the cache: the rows that took a block are appended to `grown`."""
        position = seq.step_position
        for row in seq.rows:
            table = self.tables[row]
            if len(table.blocks) * self.blocks.block_size <= position:
                need = self.blocks.blocks_for(position + 1) - len(table.blocks)
                if not (self._free_blocks(need) and self.blocks.grow(table, position + 1)):
                    return False
                grown.append(row)
        return True

    def preempt(self, seq: TranslationSequence) -> None:
        """Give back its rows, blocks and cross slot (an encoder output kept for reuse stays findable), keeping
        its decoding state: admitted again, it replays its positions and goes on (see the module docstring)."""
        seq.resume_at = seq.next_position
        self.release(seq)

    def release(self, seq: TranslationSequence) -> None:
        """Give back what `reserve` claimed (idempotent)."""
        if seq.rows:
            for row in seq.rows:
                self.blocks.release(self.tables.pop(row))
            self.rows.free(seq.rows)
            seq.rows = []
        if seq.cross_slot >= 0:
            slot, seq.cross_slot = seq.cross_slot, -1
            self._readers[slot] -= 1
            if self._readers[slot] == 0:
                del self._readers[slot]
                if slot in self._source_of_slot:
                    self._idle_slots[slot] = None  # kept for the next identical source, until its blocks are needed
                else:
                    self.blocks.release(self.source_tables.pop(slot))
                    self.cross_slots.free([slot])

    # ----------------------------------------------------------------------------------------------
    # Forward passes
    # ----------------------------------------------------------------------------------------------
    def encode(self, seqs: Sequence[TranslationSequence]) -> None:
        """Encode the sources not encoded before as one padded batch into their cross slots."""
        seqs = [s for s in seqs if not s.encoded]
        if not seqs:
            return
        lengths = [len(s.job.source_ids) for s in seqs]
        src = torch.full((len(seqs), max(lengths)), self.cfg.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            src[i, : lengths[i]] = torch.tensor(s.job.source_ids)
        dev = self.device
        self.model.start(src.to(dev), torch.tensor(lengths, device=dev), self.cache,
                         torch.tensor([s.cross_slot for s in seqs], device=dev))
        for s in seqs:
            s.encoded = True
            source = source_key(s.job)
            if self.reuse_sources and source not in self._slot_of_source:  # (two in one batch: the first)
                self._slot_of_source[source], self._source_of_slot[s.cross_slot] = s.cross_slot, source

    def begin(self, seq: TranslationSequence) -> None:
        """After `encode`: a beam request gets its search state (a preempted one keeps its own)."""
        if seq.search is not None:
            return
        if seq.job.constraints:
            seq.search = ConstrainedBeamSearch(self.beam_settings(seq.job), self.cfg.decoder_start_token_id,
                                               seq.job.constraints, seq.job.constraint_terms, device=self.device)
        elif not seq.greedy:
            seq.search = BeamSearch(self.beam_settings(seq.job), self.cfg.decoder_start_token_id,
                                    device=self.device, width=self.width)

    def decode(self, seqs: Sequence[TranslationSequence]) -> tuple[Tensor, Spans]:
        """One decoder step for every row of every sequence: logits (rows, V) and each sequence's span."""
        rows, crosses, tokens, positions, spans = [], [], [], [], []
        from_device: list[tuple[int, ChosenTokens, int]] = []
        beam_rows: list[int] = []
        beam_tokens: list[Tensor] = []
        grown: list[int] = []
        for s in seqs:
            if not self._grow_rows(s, grown):  # (the engine makes room first, preempting where it must)
                raise RuntimeError("the translation KV cache ran out of blocks")
            n, start, position = len(s.rows), len(rows), s.step_position
            spans.append((start, start + n))
            if s.greedy and s.unresolved and not s.replaying:  # its last token is still on the device
                from_device.append((start, *s.fed_from))
                tokens.append(0)
            elif s.greedy:
                tokens.append(s.generated[position - 1] if position else self.cfg.decoder_start_token_id)
            else:
                beam_rows += [start + place for place in s.batch_places()]
                beam_tokens.append(s.search.tokens_at(position) if s.replaying else s.search.last_tokens)
                tokens += [0] * n  # filled in on the device below
            positions += [position] * n
            rows += sorted(s.rows)
            crosses += [s.cross_slot] * n
        self.cache.self_kv.set_tables(grown, [self.tables[row].blocks for row in grown])
        dev = self.device
        token_ids = feed_tokens(tokens, from_device, dev)
        if beam_rows:  # the beams' tokens stay on the device: no copy to the host and back
            token_ids[to_device(beam_rows, dev)] = torch.cat(beam_tokens)
        if self.graphed is not None:  # the whole static caches, batch padded to a captured bucket
            return self.graphed(token_ids, positions, rows, crosses).float(), spans
        logits = self.model.decode_step(
            token_ids, to_device(positions, dev), self.cache,
            to_device(rows, dev), to_device(crosses, dev),
            kv_len=max(positions) + 1, src_len=max(len(s.job.source_ids) for s in seqs),
        ).float()
        return logits, spans

    # ----------------------------------------------------------------------------------------------
    # Next tokens
    # ----------------------------------------------------------------------------------------------
    def advance(self, seqs: Sequence[TranslationSequence], logits: Tensor, spans: Spans,
                on_group_error: Callable[[list[TranslationSequence], Exception], None] | None = None) -> list[int | None]:
        """Choose every greedy row's next token (one argmax) and advance the beam requests in groups that step
        together. Returns the greedy sequences' tokens (None for beam ones, `REPLAYED` for those that recomputed
        a position of their cache). A group whose step fails is passed to `on_group_error` (its beam states may
        have moved, so it cannot run again); without it, it raises."""
        results, greedy = self.advance_later(seqs, logits, spans, on_group_error)
        if greedy is not None:
            place = {id(s): i for i, s in enumerate(seqs)}
            for s, token, logprob in zip(greedy.seqs, *self.read_greedy(greedy), strict=True):
                results[place[id(s)]] = token
                s.logprob_sum += logprob
        return results

    @staticmethod
    def read_greedy(chosen: ChosenTokens) -> tuple[list[int], list[float]]:
        """A step's greedy tokens and their log-probabilities on the host (waiting for the device)."""
        tokens, (logprobs,) = chosen.read()
        return tokens, logprobs

    def ends_by_length(self, seq: TranslationSequence) -> bool:
        """Its unresolved token is its last (max_new_tokens): no step follows it."""
        return seq.unresolved > 0 and len(seq.generated) + seq.unresolved >= seq.job.max_new_tokens

    def advance_later(self, seqs: Sequence[TranslationSequence], logits: Tensor, spans: Spans,
                      on_group_error: Callable[[list[TranslationSequence], Exception], None] | None = None,
                      ) -> tuple[list[int | None], ChosenTokens | None]:
        """`advance` without waiting for the greedy rows' tokens: they stay on the device (a next `decode`
        feeds them), returned as a `ChosenTokens` with their log-probabilities (None without greedy rows), and
        None in their places in the list until read. Beam groups advance now (their rows are reassigned on the
        host)."""
        span = {id(s): sp for s, sp in zip(seqs, spans, strict=True)}
        replayed = {id(s) for s in seqs if s.replaying}  # their logits are dropped: nothing is chosen
        for s in seqs:
            s.replayed += id(s) in replayed
        choosing = [s for s in seqs if id(s) not in replayed]
        greedy = [s for s in choosing if s.greedy]
        pending = None
        if greedy:
            tokens, log_probs = greedy_tokens(self.pipeline, logits, [span[id(s)][0] for s in greedy], greedy)
            pending = ChosenTokens(greedy, tokens, (log_probs,))
        groups: dict[tuple, list[TranslationSequence]] = {}
        for s in choosing:
            if not s.greedy:
                groups.setdefault(s.search.group_key(), []).append(s)
        for group in groups.values():
            try:
                self._advance_beams(group, logits, span)
            except Exception as exc:
                if on_group_error is None:
                    raise
                on_group_error(group, exc)
        return [REPLAYED if id(s) in replayed else None for s in seqs], pending

    def _advance_beams(self, group: list[TranslationSequence], logits: Tensor, span: dict[int, tuple[int, int]]) -> None:
        places = [span[id(s)][0] + place for s in group for place in s.batch_places()]
        rows = [s for s in group for _ in s.rows]  # each beam row reads its request's parameters
        # Positions of each row's cache written so far (the group's sequences may be at different steps).
        filled = {row: s.search.step_index + 1 for s in group for row in s.rows}
        parents = advance_beams(self.pipeline, [s.search for s in group], logits, places, rows)  # one group_key
        # A beam that takes over another parent's cache forks that parent's table: shared full blocks, a copy of
        # the last partial one. Copying whole rows cost more than the decoder step itself.
        src, dst = self._reassign_rows(group, parents.tolist())
        copies = []
        for parent_row, row in zip(src, dst, strict=True):
            self.blocks.release(self.tables[row])
            self.tables[row], copy = self.blocks.fork(self.tables[parent_row], filled[parent_row])
            if copy is not None:
                copies.append(copy)
        self.cache.self_kv.set_tables(dst, [self.tables[row].blocks for row in dst])
        self.cache.self_kv.copy_positions(copies)

    @staticmethod
    def _reassign_rows(group: list[TranslationSequence], parents: list[list[int]]) -> tuple[list[int], list[int]]:
        """Give each new beam a row: the first child of a parent continues in the parent's row, further children
        take the rows of parents that left none. Returns the (source, destination) rows to copy: one per extra
        child, where keeping beam j in row j copies nearly every row at every step."""
        src: list[int] = []
        dst: list[int] = []
        for seq, beam_parents in zip(group, parents, strict=True):
            old = seq.rows
            new: list[int | None] = [None] * len(beam_parents)
            continued: set[int] = set()
            for j, p in enumerate(beam_parents):
                if p not in continued:
                    continued.add(p)
                    new[j] = old[p]
            spare = iter([old[p] for p in range(len(old)) if p not in continued])
            for j, p in enumerate(beam_parents):
                if new[j] is None:
                    new[j] = next(spare)
                    src.append(old[p])
                    dst.append(new[j])
            seq.rows = new
        return src, dst

    def append(self, seq: TranslationSequence, token: int | None) -> str | None:
        """Record a greedy token (beam requests: None) and return the finish reason when `seq` has ended."""
        if token == REPLAYED:
            return None
        if seq.greedy:
            seq.generated.append(token)
            if token == self.eos:
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.job.max_new_tokens:
                seq.finish_reason = "length"
        elif seq.search.done:
            ids = seq.search.best()
            seq.finish_reason = "stop" if ids and ids[-1] == self.eos else "length"
        return seq.finish_reason


def row_blocks(max_source_len: int, max_target_len: int, block_size: int) -> int:
    """The blocks one decoder row and one source take at their longest: what each row of a pool that never
    preempts is given."""
    return -(-max_source_len // block_size) + -(-max_target_len // block_size)


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


def translate(loaded: LoadedModel, sources: Sequence[Sequence[int]], num_beams: int | None = None,
              max_new_tokens: int | None = None, *, runner: Seq2SeqRunner | None = None,
              max_rows: int = 64, forced_first_token: int | None = None) -> list[TranslationSequence]:
    """Translate source id lists with the checkpoint's defaults (or the given beams / length; a multilingual
    translator's target language code as `forced_first_token`). Each result's `output_ids` holds its ids
    (eos included when reached; the forced token first)."""
    jobs = [translation_job(loaded, s, num_beams, max_new_tokens, forced_first_token) for s in sources]
    return run_jobs(loaded, jobs, runner=runner, max_rows=max_rows)


@torch.inference_mode()
def run_jobs(loaded: LoadedModel, jobs: Sequence[TranslationJob], *, runner: Seq2SeqRunner | None = None,
             max_rows: int = 64) -> list[TranslationSequence]:
    """Run translation jobs to their ends, as many at a time as the runner's rows allow."""
    if runner is None:
        need = sum(j.num_beams for j in jobs)
        runner = Seq2SeqRunner(loaded, num_rows=max(1, min(max_rows, need), *(j.num_beams for j in jobs)),
                               cuda_graphs=False)
    seqs = [TranslationSequence(j) for j in jobs]
    waiting, running = collections.deque(seqs), []
    try:
        while waiting or running:
            started = []
            while waiting and runner.reserve(waiting[0]):
                started.append(waiting.popleft())
            if started:
                runner.encode(started)
                for s in started:
                    runner.begin(s)
                running += started
            logits, spans = runner.decode(running)
            tokens = runner.advance(running, logits, spans)
            for s, t in zip(list(running), tokens, strict=True):
                if runner.append(s, t) is not None:
                    running.remove(s)
                    runner.release(s)
    finally:
        for s in running:
            runner.release(s)
    return seqs
