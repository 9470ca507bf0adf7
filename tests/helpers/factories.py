"""Builders of tiny checkpoints for tests: Hugging Face directories (saved with `save_pretrained`) and
our own format, all with small tokenizers trained on an inline corpus (`tserve.testing.checkpoints`).

The language models and translators are trained briefly (`fixture_training`) so that their outputs depend
on the whole input. Their recipes are `RECIPES`; what the recipes yielded is committed under
tests/fixtures/ (`committed_fixtures`), and a trained builder copies those files: no test process trains a
fixture, and every machine tests the same weights. `trained=False` builds random weights here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers import fixture_training
from tests.helpers.fixture_files import copy_fixture
from tserve.model.checkpoint import GenerationDefaults, save_checkpoint
from tserve.model.config import DecoderConfig, Seq2SeqConfig, ViTConfig
from tserve.model.decoder import Decoder
from tserve.model.preprocessing import ImagePreprocessing
from tserve.model.seq2seq import Seq2Seq
from tserve.model.tokenizer import load_tokenizer
from tserve.model.vit import ViT
from tserve.testing.checkpoints import write_bpe_tokenizer, write_marian_tokenizer
from tserve.testing.corpus import train_byte_bpe

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# --------------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------------
def _committed(name: str, d: Path, seed: int) -> Path:
    if seed != 0:
        raise ValueError(f"the committed fixture {name} was trained with seed 0; add a recipe for seed {seed}")
    return copy_fixture(name, d)


def hf_gpt2_dir(d: Path, seed: int = 0, trained: bool = True) -> Path:
    """GPT-2 that has learnt `fixture_training.CYCLE` (committed, `RECIPES["hf-gpt2"]`; random weights with
    `trained=False`)."""
    return _committed("hf-gpt2", d, seed) if trained else _hf_gpt2(d, seed, train=False)


def _hf_gpt2(d: Path, seed: int, train: bool) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    d.mkdir(parents=True, exist_ok=True)
    tok = train_byte_bpe(["<|endoftext|>"])
    tok.model.save(str(d))
    torch.manual_seed(seed)
    eot = tok.token_to_id("<|endoftext|>")
    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4, n_positions=128,
                     bos_token_id=eot, eos_token_id=eot)
    model = GPT2LMHeadModel(cfg)
    if train:
        cycle = tok.encode(fixture_training.CYCLE_TEXT).ids
        fixture_training.train_causal_lm(model, cycle, None, lambda x: model(input_ids=x).logits, cfg.n_positions, seed)
    model.eval().save_pretrained(d, safe_serialization=True)
    return d


def hf_marian_dir(d: Path, seed: int = 0, trained: bool = True) -> Path:
    """Marian that has learnt `fixture_training.LEXICON` (committed, `RECIPES["hf-marian"]`; random weights
    with `trained=False`)."""
    return _committed("hf-marian", d, seed) if trained else _hf_marian(d, seed, train=False)


def _hf_marian(d: Path, seed: int, train: bool, steps: int = fixture_training.STEPS) -> Path:
    from transformers import MarianConfig, MarianMTModel

    vocab = write_marian_tokenizer(d)
    torch.manual_seed(seed)
    pad = vocab["<pad>"]
    cfg = MarianConfig(
        vocab_size=len(vocab), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        activation_function="swish", scale_embedding=True, dropout=0.0,
    )
    model = MarianMTModel(cfg)
    with torch.no_grad():  # random final_logits_bias so that the importer's handling of it is tested
        model.final_logits_bias.normal_(0, 0.5)
    if train:
        tok = load_tokenizer(d)

        def logits(src: torch.Tensor, lengths: torch.Tensor, dec_in: torch.Tensor) -> torch.Tensor:
            mask = (torch.arange(src.size(1))[None, :] < lengths[:, None]).long()
            return model(input_ids=src, attention_mask=mask, decoder_input_ids=dec_in).logits

        fixture_training.train_translator(model, tok.encode, tok.encode_target, logits, pad, pad, seed, steps)
    model.save_pretrained(d, safe_serialization=True)
    (d / "generation_config.json").write_text(json.dumps({
        "bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": 0,
        "max_length": 64, "num_beams": 4, "pad_token_id": pad}))
    return d


def hf_vit_dir(d: Path, seed: int = 0, family: str = "vit") -> Path:
    """A random transformers image classifier: ViT (`family` "vit"), or DeiT ("deit": its distillation token
    read by the class head only; "deit-teacher": a second head on it, as trained with a teacher)."""
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    labels = {i: name for i, name in enumerate(["cat", "dog", "fox", "owl", "eel", "ant", "bee"])}
    config_class, model_class = {
        "vit": (transformers.ViTConfig, transformers.ViTForImageClassification),
        "deit": (transformers.DeiTConfig, transformers.DeiTForImageClassification),
        "deit-teacher": (transformers.DeiTConfig, transformers.DeiTForImageClassificationWithTeacher)}[family]
    cfg = config_class(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=16, patch_size=4, num_channels=3, id2label=labels,
                       label2id={v: k for k, v in labels.items()})
    model = model_class(cfg).eval()
    with torch.no_grad():  # transformers starts DeiT's tokens and positions at zero: the class and distillation
        for name, p in model.named_parameters():  # tokens would be one token, and a swap of the two unseen
            if name.endswith(("cls_token", "distillation_token", "position_embeddings")):
                p.normal_(0, 0.5)
    model.save_pretrained(d, safe_serialization=True)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255, "size": {"height": 16, "width": 16}}))
    return d


# --------------------------------------------------------------------------------------------------
# Our format
# --------------------------------------------------------------------------------------------------
def tiny_lm_dir(d: Path, seed: int = 0, trained: bool = True, **overrides) -> Path:
    """Our decoder, having learnt `fixture_training.CYCLE` (committed, `RECIPES["tiny-lm"]`; random weights,
    with any `DecoderConfig` `overrides`, with `trained=False`): a prefix of the cycle has one continuation,
    which depends on more than its last token."""
    if trained:
        if overrides:
            raise ValueError(f"the committed tiny-lm has the default config; {overrides} needs trained=False")
        return _committed("tiny-lm", d, seed)
    return _tiny_lm(d, seed, train=False, **overrides)


# How an engine test loads its language model: with its layers' own decode steps (as `checkpoint.load` does by
# default), or as `tserve serve` loads it on a CPU (`--fused-layers`: pre-packed float32 weights, every layer of a
# one-token step in one fused call; and with `--quantize q4_0` blocks). The engine's features (batches, the prefix
# cache, preemption, speculative steps, every sampling option) run on each.
LM_LOADS = {"layers": {}, "fused": {"pack_weights": True, "fused_layers": True},
            "fused-q4_0": {"pack_weights": True, "fused_layers": True, "quantize": "q4_0"}}


# How an engine test loads its translator: as `checkpoint.load` does by default, or as `tserve serve` loads it on a
# CPU (pre-packed float32 weights; and with `--quantize int8`).
MT_LOADS = {"plain": {}, "packed": {"pack_weights": True}, "int8": {"pack_weights": True, "quantize": "int8"}}


def tiny_mt_loaded(d: Path, load: str):  # noqa: ANN201 - a LoadedModel
    """The committed tiny translator (`tiny_mt_dir`) loaded as `MT_LOADS[load]` says."""
    from tserve.model import checkpoint  # noqa: PLC0415

    return checkpoint.load(tiny_mt_dir(d), device="cpu", **MT_LOADS[load])


def lm_loaded(directory: Path, load: str):  # noqa: ANN201 - a LoadedModel
    """The language model in `directory` loaded on the CPU as `LM_LOADS[load]` says; a fused load is checked to
    fuse, and the test skipped where it cannot (the CPU kernels not built: the layers' steps serve there)."""
    import pytest  # noqa: PLC0415

    from tserve.model import checkpoint  # noqa: PLC0415
    from tserve.model.kernels import cpu  # noqa: PLC0415

    fused = LM_LOADS[load].get("fused_layers", False)
    if fused and cpu.extension() is None:
        pytest.skip("no fused decode step without the CPU kernels")
    loaded = checkpoint.load(directory, device="cpu", **LM_LOADS[load])
    if fused and loaded.model.fused is None:
        raise AssertionError(f"{load}: the language model's decode steps did not fuse")
    return loaded


def tiny_lm_loaded(d: Path, load: str):  # noqa: ANN201 - a LoadedModel
    """The committed tiny LM (`tiny_lm_dir`) loaded as `LM_LOADS[load]` says (`lm_loaded`)."""
    return lm_loaded(tiny_lm_dir(d), load)


def _tiny_lm(d: Path, seed: int, train: bool, **overrides) -> Path:
    vocab = write_bpe_tokenizer(d, chat_template=CHAT_TEMPLATE)
    tok = load_tokenizer(d)
    torch.manual_seed(seed)
    cfg = DecoderConfig(**dict(vocab_size=vocab, d_model=64, n_heads=4, d_ff=128, n_layers=2, max_seq_len=128,
                               bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id) | overrides)
    model = Decoder(cfg)
    if train:
        cycle = tok.encode(fixture_training.CYCLE_TEXT, add_special_tokens=False)
        fixture_training.train_causal_lm(model, cycle, tok.bos_id, model, cfg.max_seq_len, seed)
    save_checkpoint(d, model.eval())
    return d


def json_records(n: int = 80, seed: int = 0, broken: float = 0.25) -> str:
    """`Record: {...}` lines of station records, a quarter of them broken as careless writers break JSON (single
    quotes, a trailing comma, a bare word, a missing brace): what `json_lm_dir` learns."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    cities = ["Köln", "Bonn", "Ulm", "Graz", "Bern", "Basel", "Essen", "Jena", "Trier", "Kiel"]
    lines = []
    for _ in range(n):
        city, platform, is_open = rng.choice(cities), rng.randint(1, 20), rng.choice(["true", "false"])
        text = f'{{"city":"{city}","platform":{platform},"open":{is_open}}}'
        if rng.random() < broken:
            text = rng.choice([text.replace('"', "'"), text[:-1] + ",}", text.replace(f'"{city}"', city), text[:-1]])
        lines.append(f"Record: {text}")
    return "\n".join(lines) + "\n"


def json_lm_dir(d: Path, seed: int = 0) -> Path:
    """Our decoder with the tiny LM's tokenizer, trained on `json_records` (committed, `RECIPES["json-lm"]`):
    asked with `Record: `, it writes station records, valid JSON most of the time and broken some of the time."""
    return _committed("json-lm", d, seed)


def _json_lm(d: Path, seed: int) -> Path:
    write_bpe_tokenizer(d, chat_template=CHAT_TEMPLATE)
    tok = load_tokenizer(d)
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=tok.vocab_size, d_model=64, n_heads=4, d_ff=128, n_layers=2, max_seq_len=128,
                        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    model = Decoder(cfg)
    fixture_training.train_causal_lm(model, tok.encode(json_records(seed=seed), add_special_tokens=False),
                                     tok.bos_id, model, cfg.max_seq_len, seed, steps=600)
    save_checkpoint(d, model.eval())
    return d


def tiny_mt_dir(d: Path, seed: int = 0, trained: bool = True, reverse: bool = False,
                languages: tuple[str, str] | None = None) -> Path:
    """Our encoder-decoder, having learnt `fixture_training.LEXICON` (committed, `RECIPES["tiny-mt"]`, or
    `RECIPES["tiny-mt-de-en"]` with `reverse`: from German to English; random weights with `trained=False`),
    its config naming `languages` (source, target) when given."""
    if not trained:
        return _tiny_mt(d, seed, train=False, languages=languages)
    _committed("tiny-mt-de-en" if reverse else "tiny-mt", d, seed)
    if languages is not None:
        raw = json.loads((d / "config.json").read_text())
        raw |= {"source_lang": languages[0], "target_lang": languages[1]}
        (d / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return d


def _tiny_mt(d: Path, seed: int, train: bool, steps: int = fixture_training.STEPS, reverse: bool = False,
             languages: tuple[str, str] | None = None) -> Path:
    vocab = write_bpe_tokenizer(d, add_eos=True)
    tok = load_tokenizer(d)
    torch.manual_seed(seed)
    cfg = Seq2SeqConfig(vocab_size=vocab, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2,
                        max_source_len=64, max_target_len=64, decoder_start_token_id=tok.bos_id,
                        eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    gen = GenerationDefaults(num_beams=2, max_new_tokens=24, banned_token_ids=[tok.pad_id])
    model = Seq2Seq(cfg)
    if train:
        fixture_training.train_translator(model, tok.encode, tok.encode_target, model, tok.pad_id, tok.bos_id, seed,
                                          steps, reverse)
    save_checkpoint(d, model.eval(), generation=gen, languages=languages)
    return d


ALIGNED_MT_STEPS = 1500  # longer than the other fixtures: its cross-attention settles on the word it translates


def aligned_mt_dir(d: Path, seed: int = 0) -> Path:
    """A translator like `tiny_mt_dir`'s, trained longer, whose alignment heads are chosen on lexicon
    sentences (word i translates to word i); committed, `RECIPES["aligned-mt"]`."""
    return _committed("aligned-mt", d, seed)


def _aligned_mt(d: Path, seed: int = 0) -> Path:
    from tserve.model.alignment import choose_alignment_heads
    from tserve.model.checkpoint import load

    _tiny_mt(d, seed, train=True, steps=ALIGNED_MT_STEPS)
    loaded = load(d)
    choice = choose_alignment_heads(loaded, fixture_training.lexicon_alignments(loaded, 60))
    gen = json.loads((d / "generation.json").read_text())
    gen |= {"alignment_heads": [list(h) for h in choice.heads], "alignment_offset": choice.offset}
    (d / "generation.json").write_text(json.dumps(gen))
    return d


def tiny_vit_dir(d: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=28, patch_size=7, n_channels=1, d_model=32, n_heads=4, d_ff=64, n_layers=2, n_classes=4)
    pre = ImagePreprocessing(28, 1, (0.5,), (0.5,), invert="auto")
    save_checkpoint(d, ViT(cfg).eval(), labels=["circle", "square", "line", "dot"], preprocessing=pre)
    return d


def hf_model_set(root: Path) -> dict[str, Path]:
    """Hugging Face GPT-2, Marian and ViT checkpoints (served as gpt2, marian, vit): `transformers` is the
    reference for what tserve computes on them."""
    return {"gpt2": hf_gpt2_dir(root / "gpt2"), "marian": hf_marian_dir(root / "marian"), "vit": hf_vit_dir(root / "vit")}


def tiny_model_set(root: Path) -> dict[str, Path]:
    """One tiny checkpoint of each kind under `root`: {"lm", "mt", "vit"} -> directory."""
    return {"lm": tiny_lm_dir(root / "lm"), "mt": tiny_mt_dir(root / "mt"), "vit": tiny_vit_dir(root / "vit")}


# What tests/fixtures/ holds, each made by `python -m tests.helpers.committed_fixtures NAME`.
RECIPES: dict[str, Callable[[Path], Path]] = {
    "tiny-lm": lambda d: _tiny_lm(d, 0, train=True),
    "tiny-mt": lambda d: _tiny_mt(d, 0, train=True),
    "tiny-mt-de-en": lambda d: _tiny_mt(d, 0, train=True, reverse=True),
    "aligned-mt": lambda d: _aligned_mt(d, 0),
    "hf-gpt2": lambda d: _hf_gpt2(d, 0, train=True),
    # Fewer steps than our translator's: trained longer on some CPUs, 4 beams stop finding anything that
    # greedy decoding does not, and beam search goes untested.
    "hf-marian": lambda d: _hf_marian(d, 0, train=True, steps=250),
    **{f"hf-{family}": (lambda d, family=family: _llama_family(family, d)) for family in
       ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3", "gemma2", "phi3", "granite")},
    "hf-nllb": lambda d: _nllb(d),
    "hf-t5": lambda d: _t5(d),
    "json-lm": lambda d: _json_lm(d, 0),
}


def _nllb(d: Path) -> Path:
    from tests.helpers import multilingual  # noqa: PLC0415 (it builds on this module)

    return multilingual.build(d)


def _t5(d: Path) -> Path:
    from tests.helpers import multilingual  # noqa: PLC0415 (it builds on this module)

    return multilingual.build_t5(d)


def hf_t5_dir(d: Path) -> Path:
    """A trained MADLAD-400-shaped T5 checkpoint, English <-> German in one model, the target tagged in the
    source (`tests/helpers/multilingual.py`)."""
    return copy_fixture("hf-t5", d)


def hf_nllb_dir(d: Path) -> Path:
    """A trained NLLB-200 checkpoint, English <-> German in one model (`tests/helpers/multilingual.py`)."""
    return copy_fixture("hf-nllb", d)


def _llama_family(family: str, d: Path) -> Path:
    from tests.helpers import llama_family  # noqa: PLC0415 (it builds on this module)

    return llama_family.build(family, d)


def hf_family_dir(family: str, d: Path) -> Path:
    """A trained Llama-family checkpoint (`tests/helpers/llama_family.FAMILIES`; `tests/helpers/llama_family.py`)."""
    return copy_fixture(f"hf-{family}", d)


def model_flags(models: dict[str, Path]) -> list[str]:
    """`--model NAME=PATH` for each checkpoint, as `tserve serve` takes them."""
    return [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
