"""Tiny Llama-family checkpoints, as `save_pretrained` writes them, with the tokenizers and chat templates of
the real families:

    hf-llama    Llama 3 style: byte-level BPE whose post-processor adds <|begin_of_text|>, `llama3` rope
                scaling (original context 32 of 128, so that it matters), two eos ids, untied head
    hf-mistral  SentencePiece BPE with byte fallback and add_bos_token (Mistral / TinyLlama), [INST] template
    hf-qwen2    ChatML, q/k/v biases, tied embeddings
    hf-qwen3    ChatML, per-head q/k norm, head_dim (32) != hidden / heads (16), untied head
    hf-smollm3  ChatML, its second layer's attention without positions (NoPE), tied embeddings
    hf-gemma3   Gemma's template (no system role), (1 + w) norms on either side of each sub-layer, q/k norms,
                a sliding first layer (window 16) with a rope base of its own, linear rope scaling on the
                global one, query_pre_attn_scalar 24 for a head size of 32, GeGLU, tied embeddings
    hf-gemma2   as Gemma 3 without q/k norms or a local rope base; attention and final logits soft-capped
                (caps small enough to matter: 4 and 8)
    hf-phi3     Phi-3's template, fused qkv and gate_up projections, half of each head rotated (Phi-4-mini's
                partial rotary), LongRoPE factors (an original context of 128: the short ones), every layer
                sliding (window 48)
    hf-granite  Granite's template, embedding / attention / residual multipliers and logits scaling

All have grouped-query attention (4 query heads, 2 kv heads) and have learnt `fixture_training.CYCLE`
(committed under tests/fixtures/, `factories.RECIPES`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece as spm
import torch
from tokenizers import Tokenizer, processors

from tests.helpers import fixture_training
from tserve.testing.corpus import DE, EN, train_byte_bpe

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3", "gemma2", "phi3", "granite")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- if message['content'] == '' %}{% continue %}{% endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.name %}{{- message.name | tojson }}: {% endif %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Gemma's (2 and 3, text only): no system role; a system message is prepended to the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GRANITE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + "
    "message['content'] + '<|end_of_text|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
TEMPLATES = {"llama": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "qwen2": CHATML_TEMPLATE, "qwen3": CHATML_TEMPLATE,
             "smollm3": CHATML_TEMPLATE, "gemma3": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "phi3": PHI3_TEMPLATE,
             "granite": GRANITE_TEMPLATE}
_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              num_hidden_layers=2, max_position_embeddings=128)


def _byte_bpe(d: Path, special: list[str], bos: str | None, eos: str, template: str) -> dict[str, int]:
    tok = train_byte_bpe(special)
    if bos is not None:  # Llama 3: the post-processor puts <|begin_of_text|> in front
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "chat_template": template, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {t: tok.token_to_id(t) for t in special}


def _sentencepiece(d: Path) -> dict[str, int]:
    """Mistral / TinyLlama: a SentencePiece BPE with byte fallback, converted to tokenizer.json by
    transformers; tokenizer_config.json says add_bos_token, and chat_template.jinja holds the template."""
    from transformers import LlamaTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((EN + DE + fixture_training.CYCLE) * 3), model_writer=model, model_type="bpe",
        vocab_size=400, byte_fallback=True, character_coverage=0.99, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2, hard_vocab_limit=False,
    )
    (d / "tokenizer.model").write_bytes(model.getvalue())
    tok = LlamaTokenizer.from_pretrained(d)
    tok.save_pretrained(d)
    (d / "tokenizer.model").unlink()  # tokenizer.json is what is served
    # As TinyLlama's and Mistral's tokenizer.json: the post-processor puts <s> in front.
    backend = Tokenizer.from_file(str(d / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    backend.save(str(d / "tokenizer.json"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config |= {"add_bos_token": True, "add_eos_token": False}
    for key in ("extra_special_tokens", "is_local", "local_files_only"):
        config.pop(key, None)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (d / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    return {"<s>": tok.bos_token_id, "</s>": tok.eos_token_id}


def build(family: str, d: Path, seed: int = 0, train: bool = True) -> Path:
    """A `save_pretrained` directory of `family` (see the module docstring)."""
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    if family == "llama":
        ids = _byte_bpe(d, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                            "<|end_header_id|>"], "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE)
        bos, eos = ids["<|begin_of_text|>"], [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        cfg = transformers.LlamaConfig(
            **_SHAPE, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif family == "mistral":
        ids = _sentencepiece(d)
        bos, eos = ids["<s>"], ids["</s>"]
        cfg = transformers.MistralConfig(**_SHAPE, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                                         sliding_window=None, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})
    elif family in ("gemma3", "gemma2"):
        ids = _byte_bpe(d, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
                        GEMMA_TEMPLATE)
        bos, eos = ids["<bos>"], [ids["<eos>"], ids["<end_of_turn>"]]
        common = dict(_SHAPE, hidden_activation="gelu_pytorch_tanh", sliding_window=16, pad_token_id=ids["<pad>"],
                      bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True)
        if family == "gemma3":
            cfg = transformers.Gemma3TextConfig(
                **common, head_dim=32, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})
        else:
            cfg = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=32, attn_logit_softcapping=4.0,
                                            final_logit_softcapping=8.0)
    elif family == "phi3":
        ids = _byte_bpe(d, ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None,
                        "<|endoftext|>", PHI3_TEMPLATE)
        bos, eos = None, [ids["<|end|>"], ids["<|endoftext|>"]]
        rotary = int(_SHAPE["hidden_size"] // _SHAPE["num_attention_heads"] * 0.5)
        cfg = transformers.Phi3Config(
            **_SHAPE, tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=eos,
            pad_token_id=ids["<|endoftext|>"], sliding_window=48, original_max_position_embeddings=128,
            partial_rotary_factor=0.5,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0 + 0.25 * i for i in range(rotary // 2)],
                             "long_factor": [1.0 + 2.0 * i for i in range(rotary // 2)],
                             "original_max_position_embeddings": 128})
    elif family == "granite":
        ids = _byte_bpe(d, ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"], None, "<|end_of_text|>",
                        GRANITE_TEMPLATE)
        bos, eos = None, ids["<|end_of_text|>"]
        cfg = transformers.GraniteConfig(
            **_SHAPE, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
            embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        ids = _byte_bpe(d, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML_TEMPLATE)
        bos, eos = None, [ids["<|im_end|>"], ids["<|endoftext|>"]]
        config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                        "smollm3": transformers.SmolLM3Config}[family]
        extra = {"qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32, "tie_word_embeddings": False},
                 "smollm3": {"tie_word_embeddings": True, "no_rope_layers": [1, 0], "pad_token_id": None}}[family]
        cfg = config_class(**_SHAPE, **extra, bos_token_id=ids["<|endoftext|>"], eos_token_id=eos[0],
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vocab = json.loads((d / "tokenizer.json").read_text())
    cfg.vocab_size = len(vocab["model"]["vocab"]) + sum(1 for t in vocab["added_tokens"]
                                                         if t["content"] not in vocab["model"]["vocab"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    if family == "qwen2":  # transformers starts biases at zero; give them a part to play from the start
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, 0.5)
    if train:
        tok = transformers.AutoTokenizer.from_pretrained(d)
        cycle = tok(fixture_training.CYCLE_TEXT, add_special_tokens=False).input_ids
        fixture_training.train_causal_lm(model, cycle, bos, lambda x: model(input_ids=x).logits,
                                         cfg.max_position_embeddings, seed)
    model.eval().save_pretrained(d)
    if family in ("qwen2", "phi3"):  # the eos list lives in generation_config.json, as Qwen2.5 ships it
        gen = json.loads((d / "generation_config.json").read_text())
        (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": eos}, indent=2))
    return d
