"""The inline corpus every tiny checkpoint's tokenizer is trained on: a few English sentences and their German
translations, and the byte-level BPE trained on them."""

from __future__ import annotations

from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

EN = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small test corpus for tokenizers.",
    "Good morning. Where is the station? I don't know.",
    "The weather is nice today, isn't it?",
    "Once upon a time there was a king who had three daughters.",
]
DE = [
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Hallo Welt, dies ist ein kleiner Testkorpus für Tokenizer.",
    "Guten Morgen. Wo ist der Bahnhof? Ich weiß es nicht.",
    "Das Wetter ist heute schön, nicht wahr?",
    "Es war einmal ein König, der hatte drei Töchter.",
]


def train_byte_bpe(special: list[str], vocab_size: int = 320) -> HFBackend:
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((EN + DE) * 3, trainer)
    return tok
