"""`python -m registry.integrations.generate`: architecture names, local model directories (never a
download), the report lines, --check, and clear errors for bad paths and configs."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest

from registry.integrations import generate as cli
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module


def test_architecture_name_runs_fused_and_reports(native_artifacts, capsys):
    assert cli.main(["--model", "gemma3", "--prompt", "hello world", "--max-tokens", "6", "--check"]) == 0
    out = capsys.readouterr().out
    assert "random weights" in out and "layers 0-1: fused: qk_norm_rope_pool_fused (native-" in out
    assert re.search(r"Prompt: 11 tokens, [\d.]+ tokens-per-sec", out)
    assert re.search(r"Generation: 6 tokens, [\d.]+ tokens-per-sec", out)
    assert "Peak memory:" in out and "check: identical to mlx-lm's own caches" in out


def test_stock_mode_and_unfusable_layers(capsys):
    assert cli.main(["--model", "llama (dynamic)", "--max-tokens", "2"]) == 0
    assert re.search(r"layers 0-1: mlx-lm's own cache: .*DynamicNTKScalingRoPE", capsys.readouterr().out)
    assert cli.main(["--model", "llama", "--max-tokens", "2", "--stock"]) == 0
    assert "caches: mlx-lm's own (--stock)" in capsys.readouterr().out


def _save(tmp_path, arch="llama"):
    mx.random.seed(1)
    model = build_model(ARCHS[arch])
    model.save_weights(str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(ARCHS[arch]))
    return model


def test_local_directory_loads_the_saved_weights(native_artifacts, tmp_path, capsys):
    saved = _save(tmp_path)
    model, tok = cli.load_local(tmp_path)
    assert tok is None
    prompt = [3, 1, 4, 1, 5]
    stock = import_mlx_lm_module("cache")
    assert cli.run(model, prompt, 5, stock.make_prompt_cache(model))["tokens"] == \
        cli.run(saved, prompt, 5, stock.make_prompt_cache(saved))["tokens"]
    assert cli.main(["--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "4", "--check"]) == 0
    out = capsys.readouterr().out
    assert f"model: {tmp_path} (no tokenizer)" in out and "fused: rope_pool_fused" in out


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such directory, and not an architecture name"),
    ("file", "not a directory"),
    ("no_config", "no config.json"),
    ("bad_json", "config.json: not readable JSON"),
    ("not_object", "config.json: expected a JSON object"),
    ("no_type", "config.json: field 'model_type' missing"),
    ("bad_type", "config.json: field 'model_type': 'nope' is not an mlx-lm 0.32.2 architecture"),
    ("no_weights", "no model*.safetensors weight files"),
    ("bad_weights", "mlx-lm cannot load this model"),
])
def test_bad_model_argument_is_a_clear_error(tmp_path, capsys, case, expect):
    d = tmp_path / "m"
    d.mkdir()
    cfg = d / "config.json"
    target = d
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "file":
        target = cfg
        cfg.write_text("{}")
    elif case == "bad_json":
        cfg.write_text("{oops")
    elif case == "not_object":
        cfg.write_text("[1]")
    elif case == "no_type":
        cfg.write_text("{}")
    elif case == "bad_type":
        cfg.write_text('{"model_type": "nope"}')
    elif case == "no_weights":
        cfg.write_text(json.dumps(ARCHS["llama"]))
    elif case == "bad_weights":
        cfg.write_text(json.dumps(ARCHS["llama"]))
        mx.save_safetensors(str(d / "model.safetensors"), {"x": mx.zeros((2,))})
    assert cli.main(["--model", str(target), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err, err
    assert str(target) in err or case == "missing" and "nope" in err


@pytest.mark.parametrize("argv", [["--max-tokens", "0"], ["--max-kv-size", "0"], ["--prompt", ""], ["--model", ""]])
def test_bad_numbers_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "llama", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_prompt_the_tokenizer_encodes_to_nothing(tmp_path, capsys):
    """Was mlx-lm's "Either input_embeddings or prompt (or both) must be provided", naming no flag."""
    _save(tmp_path, "qwen3")
    _tokenizer(tmp_path)
    assert cli.main(["--model", str(tmp_path), "--prompt", " ", "--max-tokens", "2"]) == 2
    assert "--prompt ' ': the tokenizer encodes it to no tokens" in capsys.readouterr().err


# The e2e benchmark's mlx_lm_fused_cache mode: a head_dim-128 GQA llama at a real vocabulary size
# (2 layers keep it fast), batch 1 (generate_step) and batch 3 (BatchGenerator, BatchKVCache).
REAL = dict(ARCHS["llama"], hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, vocab_size=32000)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_benchmark_fused_matches_stock(native_artifacts, batch):
    mx.random.seed(0)
    model = build_model(REAL)
    prompts = [[(7 * i + 13 * b) % 32000 for i in range(20 + 9 * b)] for b in range(batch)]
    fused = cli.decode_benchmark(model, prompts, 6, fused=True)
    stock = cli.decode_benchmark(model, prompts, 6, fused=False)
    assert fused["tokens"] == stock["tokens"] and all(len(t) == 6 for t in fused["tokens"])
    assert fused["decode_tokens"] == batch * 5 and fused["decode_tokens_per_s"] > 0
    from registry.integrations.mlx_lm_cache import fused_model
    from registry.core import backend_of
    assert all(f.calls["fused"] > 0 and f.kernel.implementation == f"native-{backend_of(None)}"
               for f in fused_model(model).fusions.values())


def _tokenizer(d):
    """A 12-word WordLevel tokenizer written offline (tokenizers + transformers' fast tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("hello world the a of to and in is it".split())}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": "</s>", "unk_token": "<unk>"}))


def test_local_directory_with_tokenizer_and_mlx_lm_generate(native_artifacts, tmp_path, capsys):
    """The tokenizer is loaded from the directory; mlx-lm's own generate() and stream_generate()
    accept the fused caches and give stock mlx-lm's text."""
    import importlib

    _save(tmp_path, "qwen3")
    _tokenizer(tmp_path)
    assert cli.main(["--model", str(tmp_path), "--prompt", "hello world", "--max-tokens", "5", "--check"]) == 0
    out = capsys.readouterr().out
    assert "(with tokenizer)" in out and "Prompt: 2 tokens" in out
    model, tok = cli.load_local(tmp_path)
    from registry.integrations.mlx_lm import make_prompt_cache

    g = importlib.import_module("mlx_lm.generate")
    stock = import_mlx_lm_module("cache")
    want = g.generate(model, tok, "hello the world", max_tokens=6, prompt_cache=stock.make_prompt_cache(model))
    assert g.generate(model, tok, "hello the world", max_tokens=6, prompt_cache=make_prompt_cache(model)) == want
    streamed = "".join(r.text for r in g.stream_generate(model, tok, "hello the world", max_tokens=6,
                                                         prompt_cache=make_prompt_cache(model)))
    assert streamed == want
