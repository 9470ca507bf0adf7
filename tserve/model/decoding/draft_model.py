"""Drafts from a smaller language model of the same vocabulary (`--draft-model`): the draft model decodes k
tokens greedily after each running sequence, and the target scores them in one forward pass
(`DecoderRunner.decode_ahead`), keeping them by `speculative.accept`'s rules. A greedy draft is a point mass
on the token the draft model prefers, so the rule that keeps the target's output exactly its own for
prompt-lookup drafts keeps it here too: greedy rows keep the draft while it is the target's argmax, sampled
rows while their own draws agree with it (their tokens are the very tokens they draw without speculation).

The draft model has its own paged KV cache, on the target's rows (`seq.slot`) with a block pool of its own
(as many blocks as the target's: the draft never holds more positions than the target). Each sequence
remembers how many of its tokens the draft cache holds (`draft_computed`): a step feeds the draft model what
it has not seen yet (the prompt at first; then the last step's kept tokens and the target's own token) in one
ragged prefill, then k - 1 single-token steps. Draft positions the target kept stay valid; the rest are
overwritten by the next step's feed. On CUDA the single-token steps replay CUDA graphs captured per batch bucket
(padding rows on the draft cache's spare row); the ragged prefill stays eager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tserve.model.block_pool import BlockPool
from tserve.model.checkpoint import LoadedModel
from tserve.model.cuda_graphs import BucketedDecode, default_buckets
from tserve.model.decoder import Decoder
from tserve.model.kernels.cpu import argmax
from tserve.model.kv_cache import PagedKVCache


class DraftModel:
    def __init__(self, loaded: LoadedModel, target: LoadedModel, *, num_slots: int, max_len: int, num_blocks: int,
                 block_size: int, max_rows: int, cuda_graphs: bool = True) -> None:
        """`max_rows`: the most rows a step drafts for (`Speculation.max_rows`); `cuda_graphs`: on CUDA, the
        single-token steps of up to that many rows replay CUDA graphs."""
        check_same_vocabulary(target, loaded)
        self.model, self.device = loaded.model, loaded.device
        self.max_len = min(max_len, loaded.config.max_seq_len)
        # Checkpoints of one vocabulary may pad their output layers differently: draft only real tokens.
        self.vocab_size = min(target.config.vocab_size, loaded.config.vocab_size)
        self.cache = self.model.new_cache(num_slots, self.max_len, num_blocks=num_blocks, block_size=block_size)
        self.blocks = BlockPool(num_blocks, block_size, prefix_caching=False)
        self.graphed: BucketedDecode | None = None
        if cuda_graphs and self.device.type == "cuda" and not loaded.config.n_experts:  # (MoE: dynamic shapes)
            self.graphed = bucketed_steps(self.model, self.cache, max_rows=min(max_rows, num_slots), use_graphs=True)
            self.graphed.capture()

    def draft(self, seqs: Sequence[object], rooms: Sequence[int]) -> list[list[int]]:
        """Up to `rooms[i]` greedy draft tokens after each sequence's tokens ([] where the draft cache or the
        draft model's context has no room)."""
        out: list[list[int]] = [[] for _ in seqs]
        rows = []
        for i, (s, room) in enumerate(zip(seqs, rooms, strict=True)):
            self._settle(s)
            length = len(s.prompt_ids) + len(s.generated)
            k = min(room, self.max_len + 1 - length)  # the last draft token is never fed: k - 1 positions past
            if k > 0 and self._hold(s, length + k - 1):
                rows.append((i, s, k, length))
        if not rows:
            return out
        with torch.inference_mode():
            latest = self._catch_up([s for _, s, _, _ in rows])
            for (i, s, k, length), token in zip(rows, latest, strict=True):
                out[i] = [token]
                s.draft_base, s.draft_len = length, k
            step = 1
            while live := [(i, s, length) for i, s, k, length in rows if k > step]:
                tokens, positions = [out[i][-1] for i, _, _ in live], [length + step - 1 for _, _, length in live]
                slots = [s.slot for _, s, _ in live]
                if self.graphed is not None:
                    logits = self.graphed(tokens, positions, slots)
                else:
                    dev = self.device
                    logits = self.model.decode_step(torch.tensor(tokens, device=dev),
                                                    torch.tensor(positions, device=dev), self.cache,
                                                    torch.tensor(slots, device=dev), kv_len=max(positions) + 1)
                for (i, _, _), token in zip(live, self._greedy(logits), strict=True):
                    out[i].append(token)
                step += 1
        return out

    def kept(self, seq: object, kept: int) -> None:
        """The target kept the first `kept` tokens of this step's draft: those the draft model was fed are its
        cache's too (the last draft token never was)."""
        if seq.draft_len:
            seq.draft_computed = seq.draft_base + min(kept, seq.draft_len - 1)
            seq.draft_len = 0

    def release(self, seq: object) -> None:
        if seq.draft_table is not None:
            self.blocks.release(seq.draft_table)
        seq.draft_table, seq.draft_computed, seq.draft_len = None, 0, 0

    # ----------------------------------------------------------------------------------------------
    def _settle(self, seq: object) -> None:
        """A draft the target never judged (cut to nothing, or its step not run): only what was fed before the
        draft tokens is known to be the sequence's."""
        if seq.draft_len:
            seq.draft_computed, seq.draft_len = seq.draft_base, 0

    def _hold(self, seq: object, num_tokens: int) -> bool:
        """Blocks in the draft cache for `num_tokens` positions of `seq`, on its target row; False if none free."""
        if seq.draft_table is None:  # (its draft_computed is 0: new, or reset by `release`)
            seq.draft_table = self.blocks.admit([])
        before = len(seq.draft_table.blocks)
        if not self.blocks.grow(seq.draft_table, num_tokens):
            return False
        if len(seq.draft_table.blocks) != before or seq.draft_slot != seq.slot:
            self.cache.set_table(seq.slot, seq.draft_table.blocks)
            seq.draft_slot = seq.slot
        return True

    def _catch_up(self, seqs: list[object]) -> list[int]:
        """Feed each sequence's tokens the draft cache lacks; each one's first draft token. Rows go in ragged
        prefills, batched where the longest feed's padding stays inside every row's context (padding writes past
        a row's last position: it must stay a position the model has)."""
        feeds = [s.token_ids()[s.draft_computed:] for s in seqs]
        first: list[int] = [0] * len(seqs)
        groups: list[list[int]] = [[]]
        furthest = 0  # the latest start in the open group
        for r in sorted(range(len(seqs)), key=lambda r: len(feeds[r])):  # each row's feed the group's longest yet
            if groups[-1] and max(furthest, seqs[r].draft_computed) + len(feeds[r]) > self.max_len:
                groups.append([])
                furthest = 0
            groups[-1].append(r)
            furthest = max(furthest, seqs[r].draft_computed)
        for group in groups:
            for r, token in zip(group, self._prefill([seqs[r] for r in group], [feeds[r] for r in group]), strict=True):
                first[r] = token
        return first

    def _prefill(self, seqs: list[object], feeds: list[list[int]]) -> list[int]:
        start = [s.draft_computed for s in seqs]
        tokens = torch.zeros(len(seqs), max(map(len, feeds)), dtype=torch.long)
        for row, t in enumerate(feeds):
            tokens[row, : len(t)] = torch.tensor(t)
        dev = self.device
        logits = self.model.prefill(tokens.to(dev), torch.tensor(list(map(len, feeds)), device=dev), self.cache,
                                    torch.tensor([s.slot for s in seqs], device=dev),
                                    torch.tensor(start, device=dev) if any(start) else None)
        return self._greedy(logits)

    def _greedy(self, logits: Tensor) -> list[int]:
        return argmax(logits[:, : self.vocab_size]).tolist()


def bucketed_steps(model: Decoder, cache: PagedKVCache, *, max_rows: int, use_graphs: bool) -> BucketedDecode:
    """The draft model's single-token steps over its whole cache rows, at bucketed batch sizes of up to
    `max_rows` rows; padding rows use the cache's spare row (its table is all null blocks)."""
    return BucketedDecode(lambda tokens, positions, rows: model.decode_step(tokens, positions, cache, rows),
                          pad_values=(0, 0, cache.num_rows), buckets=default_buckets(max_rows), device=cache.k.device,
                          use_graphs=use_graphs)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft token is a target token only if both tokenizers give every id the same piece."""
    a, b = target.tokenizer, draft.tokenizer
    if a is None or b is None:
        raise ValueError("speculative decoding with a draft model needs both models' tokenizers")
    if a.vocab_size != b.vocab_size:
        differs = f"{b.vocab_size} tokens against {a.vocab_size}"
    elif (i := next((i for i in range(a.vocab_size) if a.id_to_token(i) != b.id_to_token(i)), None)) is not None:
        differs = f"token {i} is {b.id_to_token(i)!r} there, {a.id_to_token(i)!r} here"
    else:
        return
    raise ValueError(f"the draft model ({draft.path}) has another vocabulary than the model it drafts for "
                     f"({target.path}): {differs}; a draft model must use the same tokenizer")
