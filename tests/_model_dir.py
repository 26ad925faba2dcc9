"""A tiny random-weight mlx-lm model directory with a tokenizer, written offline: config.json,
model.safetensors, and a word-level tokenizer (tokenizer.json + tokenizer_config.json with a chat
template) whose vocabulary covers the model's, so every generated token decodes to one word."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from registry.integrations.coverage import ARCHS, arch_vocab
from registry.integrations.mlx_lm import build_model

WORDS = "system user assistant : hello world the a of to and in is it".split()
# Role, then content; the generation prompt ends with "assistant :". A system message renders as any other.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def write_tokenizer(d: Path, vocab_size: int, *, eos: str = "</s>", chat_template: str | None = CHAT_TEMPLATE) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", *WORDS]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens([AddedToken("</s>", special=True)])
    t.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": "<unk>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_model_dir(d: Path, arch: str = "qwen3", *, seed: int = 1, dtype: str = "float32", scale: float = 4.0,
                    **tokenizer) -> Path:
    """The model's weights (seeded; matrices times `scale`: at mlx-lm's own init scale these 64-wide
    models repeat one token, which makes token comparisons weak), its config and the tokenizer."""
    from mlx.utils import tree_flatten, tree_unflatten

    d.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build_model(ARCHS[arch], dtype=getattr(mx, dtype))
    model.update(tree_unflatten([(k, v * scale if v.ndim >= 2 else v) for k, v in tree_flatten(model.parameters())]))
    model.save_weights(str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(ARCHS[arch]))
    write_tokenizer(d, arch_vocab(ARCHS[arch]), **tokenizer)
    return d
