"""`python -m registry.integrations.generate` (mlx-aot-generate): the same output as mlx-lm's own
`mlx_lm.generate` command for the same flags (chat template, EOS, sampling, KV options), --check's
report, architecture names, local model directories (never a download), clear errors."""

from __future__ import annotations

import importlib
import json
import re
import sys

import mlx.core as mx
import pytest

from registry.integrations import generate as cli
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module
from tests._model_dir import write_model_dir, write_tokenizer

mlx_lm_generate = importlib.import_module("mlx_lm.generate")


def test_architecture_name_runs_fused_and_reports(native_artifacts, capsys):
    assert cli.main(["--model", "gemma3", "--prompt", "hello world", "--max-tokens", "6", "--check"]) == 0
    out = capsys.readouterr().out
    assert "random weights" in out and "layers 0-1: fused: qk_norm_rope_pool_fused (native-" in out
    assert re.search(r"^Prompt: 11 tokens, [\d.]+ tokens-per-sec$", out, re.M)
    assert re.search(r"^Generation: 6 tokens, [\d.]+ tokens-per-sec$", out, re.M)
    assert re.search(r"^Peak memory: [\d.]+ GB$", out, re.M)
    assert "check: identical to mlx-lm's own caches (6 tokens" in out


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
    assert f"model: {tmp_path} (no tokenizer, float32)" in out and "fused: rope_pool_fused" in out


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


@pytest.mark.parametrize("argv, flag", [
    (["--max-tokens", "0"], "--max-tokens must be >= 1, or -1"),
    (["--max-kv-size", "0"], "--max-kv-size must be >= 1"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--model", ""], "--model must not be empty"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "1.5"], "--top-p must be in [0, 1]"),
    (["--min-p", "-0.1"], "--min-p must be in [0, 1]"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
    (["--xtc-threshold", "0.9"], "--xtc-threshold must be in [0, 0.5]"),
    (["--prefill-step-size", "0"], "--prefill-step-size must be >= 1"),
    (["--quantized-kv-start", "-1"], "--quantized-kv-start must be >= 0"),
    (["--kv-bits", "7"], "argument --kv-bits: invalid choice: 7"),
    (["--kv-group-size", "16"], "argument --kv-group-size: invalid choice: 16"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--temp", "x"], "argument --temp: invalid float value: 'x'"),
    (["--chat-template-config", "{oops"], "--chat-template-config must be a JSON object"),
    (["--chat-template-config", "[1]"], "--chat-template-config must be a JSON object, got list"),
    (["--check", "--temp", "0.5"], "--check with --temp > 0 needs --seed"),
    (["--check", "--stock"], "argument --stock: not allowed with argument --check"),
])
def test_bad_flags_are_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "llama", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "Traceback" not in err, err


def test_prompt_the_tokenizer_encodes_to_nothing(tmp_path, capsys):
    """Was mlx-lm's "Either input_embeddings or prompt (or both) must be provided", naming no flag."""
    _save(tmp_path, "qwen3")
    write_tokenizer(tmp_path, 256, chat_template=None)
    assert cli.main(["--model", str(tmp_path), "--prompt", " ", "--max-tokens", "2"]) == 2
    assert "--prompt ' ': the tokenizer encodes it to no tokens" in capsys.readouterr().err


def test_until_eos_needs_a_tokenizer(capsys):
    assert cli.main(["--model", "llama", "--max-tokens", "-1"]) == 2
    assert "--max-tokens -1 (until EOS): llama has no tokenizer, so no EOS" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the same as mlx-lm's command

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=0)


def _mlx_lm(argv, capsys, monkeypatch) -> str:
    """stdout of mlx-lm 0.32.2's own `mlx_lm.generate` command, run in-process."""
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", *argv])
    capsys.readouterr()
    mlx_lm_generate.main()
    return capsys.readouterr().out


def _ours(argv, capsys) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("flags", [
    [],                                                             # mlx-lm's defaults: "hello", 100 tokens
    ["--prompt", "hello world", "--system-prompt", "the a of", "-m", "12"],
    ["--prompt", "hello world", "--prefill-response", "it is", "-m", "12"],
    ["--prompt", "hello world the", "--ignore-chat-template", "-m", "12"],
    ["--prompt", "hello", "--temp", "0.9", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3", "-m", "12"],
    ["--prompt", "hello world and the world", "--max-kv-size", "8", "-m", "12"],
    ["--prompt", "hello world", "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "4", "-m", "12"],
    ["--prompt", "hello world of", "--prefill-step-size", "3", "-m", "12"],
], ids=["defaults", "system-prompt", "prefill-response", "no-template", "sampling", "max-kv-size", "kv-bits",
        "prefill-step"])
def test_same_text_as_mlx_lm_generate(native_artifacts, model_dir, flags, capsys, monkeypatch):
    """float32, the same flags: our command prints exactly what mlx-lm's prints (--verbose False:
    the response only), through the fused kernel; --check agrees."""
    from registry.integrations.mlx_lm_cache import fused_model

    if "--kv-bits" in flags and mx.default_device() != mx.cpu and mx.cuda.is_available():
        pytest.skip("stock mlx-lm's quantized KV attention has no CUDA kernel in MLX 0.32.4 (quantized_matmul "
                    "raises): there is no stock text to compare with here")
    argv = ["--model", str(model_dir), "--verbose", "False", *flags]
    want = _mlx_lm(argv, capsys, monkeypatch)
    loaded = []
    load = cli.load
    monkeypatch.setattr(cli, "load", lambda *a: loaded.append(load(*a)) or loaded[-1])
    got = _ours(argv, capsys)
    assert got == want and len(want.split()) >= 5, (got, want)
    assert sum(f.calls["fused"] for f in fused_model(loaded[0][0]).fusions.values()) > 0
    assert cli.main([*argv, "--check"]) == 0
    assert "check: identical to mlx-lm's own caches" in capsys.readouterr().out


def test_verbose_output_has_mlx_lm_lines(native_artifacts, model_dir, capsys):
    out = _ours(["--model", str(model_dir), "--prompt", "hello world", "-m", "7"], capsys)
    lines = out.splitlines()
    assert lines[0] == f"model: {model_dir} (with tokenizer, float32) on {mx.default_device()}"
    assert "direct forward" in lines[1] and lines[2] == "=" * 10 and lines[4] == "=" * 10
    assert len(lines[3].split()) == 7                               # one word per token
    assert re.fullmatch(r"Prompt: 7 tokens, [\d.]+ tokens-per-sec", lines[5])   # "user : hello world </s> assistant :"
    assert re.fullmatch(r"Generation: 7 tokens, [\d.]+ tokens-per-sec", lines[6])
    assert re.fullmatch(r"Peak memory: [\d.]+ GB", lines[7])


def test_stops_at_eos_as_mlx_lm(native_artifacts, model_dir, tmp_path, capsys, monkeypatch):
    """The tokenizer's EOS (tokenizer_config.json) and --extra-eos-token end the text where mlx-lm's does."""
    argv = ["--prompt", "hello world", "--verbose", "False", "-m", "12"]
    words = _ours(["--model", str(model_dir), *argv], capsys).split()
    k = next(i for i in range(2, len(words)) if words[i] not in words[:i])
    eos_dir = write_model_dir(tmp_path / "eos", "qwen3", seed=0, eos=words[k])
    for extra, d in (([], eos_dir), (["--extra-eos-token", words[k]], model_dir)):
        want = _mlx_lm(["--model", str(d), *argv, *extra], capsys, monkeypatch)
        got = _ours(["--model", str(d), *argv, *extra], capsys)
        assert got == want == " ".join(words[:k]) + "\n", (extra, got, want)


def test_seed_picks_the_samples_of_an_architecture_model(capsys):
    """The weights of `--model llama` are always seed 0's; --seed seeds the sampling after them."""
    def sample(seed):
        return _ours(["--model", "llama", "--temp", "2", "--seed", seed, "-m", "8", "--verbose", "False"], capsys)

    assert sample("1") == sample("1") != sample("2")


def test_dtype_applies_to_a_directory(native_artifacts, model_dir, capsys):
    out = _ours(["--model", str(model_dir), "--dtype", "bfloat16", "-m", "3"], capsys)
    assert f"model: {model_dir} (with tokenizer, bfloat16)" in out
    model, _, _ = cli.load(str(model_dir), "bfloat16")
    assert cli.model_dtype(model) == "bfloat16" and model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_kv_bits_on_a_rotating_cache_is_a_clear_error(native_artifacts, capsys):
    """mlx-lm cannot quantize a RotatingKVCache (gemma3's sliding layers): an error naming the flags."""
    assert cli.main(["--model", "gemma3", "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0",
                     "-m", "3"]) == 2
    err = capsys.readouterr().err
    assert "error: --kv-bits 4 --kv-group-size 32: mlx-lm cannot quantize this model's KV cache" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- --check's report

# A bf16 run whose greedy tokens differ between the drop-in caches and mlx-lm's own at token 3
# (found by trying prompts on a few architectures; deterministic on the CPU).
DIVERGING = ["--model", "glm4", "--dtype", "bfloat16", "--prompt", "hello", "-m", "8"]


def _skip_unless_it_diverges(out: str) -> None:
    """Another device rounds another way: there this run may not diverge at all (on the H200 its
    tokens are identical), and the divergence report has nothing to report."""
    if "check: identical to mlx-lm's own caches" in out and mx.default_device() != mx.cpu:
        pytest.skip(f"the bf16 run's tokens are identical to stock's on {mx.default_device()}: the divergence "
                    f"report is exercised on the CPU")


def test_check_reports_a_bf16_divergence_within_tolerance(native_artifacts, capsys):
    assert cli.main([*DIVERGING, "--check"]) == 0
    out = capsys.readouterr().out
    _skip_unless_it_diverges(out)
    m = re.search(r"check: first difference at generated token (\d+): mlx-lm's own caches (\d+), drop-in (\d+)", out)
    assert m and m.group(2) != m.group(3), out
    gap = re.search(r"max \|logit difference\| ([\d.e-]+) = ([\d.]+) x max \|logit\| \(([\d.e-]+)\); "
                    r"mlx-lm's top-2 margin ([\d.e-]+)", out)
    assert gap and 0 < float(gap.group(2)) and float(gap.group(4)) <= 2 * float(gap.group(1)), out
    assert "check: within the documented bfloat16 tolerance" in out


def test_check_fails_outside_the_tolerance(native_artifacts, capsys, monkeypatch):
    from registry.integrations import tolerance

    monkeypatch.setattr(tolerance, "HALF_LOGIT_TOL", 1e-6)
    rc = cli.main([*DIVERGING, "--check"])
    captured = capsys.readouterr()
    _skip_unless_it_diverges(captured.out)
    assert rc == 1
    assert "check: first difference at generated token" in captured.out
    assert "check: FAILED: the gap is above the documented bfloat16 tolerance (1e-06 x max |logit|" in captured.err
    assert "Traceback" not in captured.err


def test_docs_state_the_tolerance_the_code_uses():
    from registry.integrations.tolerance import HALF_LOGIT_TOL
    from registry.paths import PROJECT_ROOT

    text = (PROJECT_ROOT / "docs" / "engine.md").read_text()
    assert f"`max |engine - mlx-lm| <= HALF_LOGIT_TOL * max |logit|`, `HALF_LOGIT_TOL = {HALF_LOGIT_TOL}`" in text
    assert f"bfloat16 tolerance ({HALF_LOGIT_TOL} x max |logit|" in text


def test_first_divergence_teacher_forces_on_stock_tokens():
    """float32: no tolerance (tokens must be identical); the gap is read at the first differing step."""
    mx.random.seed(0)
    model = build_model(ARCHS["llama"])
    stock = import_mlx_lm_module("cache")
    want = cli.run(model, [1, 2, 3], 4, stock.make_prompt_cache(model))["tokens"]
    got = want[:2] + [(want[2] + 1) % 256, want[3]]
    d = cli.first_divergence(model, [1, 2, 3], got, want, stock.make_prompt_cache(model), stock.make_prompt_cache(model))
    assert (d.step, d.want, d.got, d.gap, d.dtype) == (2, want[2], got[2], 0.0, "float32")
    assert d.margin > 0 and d.tolerance is None and not d.within_tolerance
    logits, dtype = cli.teacher_forced_logits(model, [1, 2, 3], want, stock.make_prompt_cache(model))
    assert logits.shape == (4, 256) and dtype == "float32" and list(logits.argmax(-1)) == want


def test_console_scripts():
    """setup.py declares both scripts, and each names the module's main (read from setup.py, so the
    check holds whether or not this checkout is pip-installed, as on the GPU host)."""
    import ast
    import importlib

    from registry.integrations import server
    from registry.paths import PROJECT_ROOT

    declared = {}
    for node in ast.walk(ast.parse((PROJECT_ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            for spec in ast.literal_eval(node.value)["console_scripts"]:
                name, target = (x.strip() for x in spec.split("="))
                module, attr = target.split(":")
                declared[name] = getattr(importlib.import_module(module), attr)
    assert declared["mlx-aot-generate"] is cli.main and declared["mlx-aot-server"] is server.main


# ----------------------------------------------------------------------------- the e2e benchmark's mode

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


def test_mlx_lm_generate_functions_take_the_drop_in_caches(native_artifacts, model_dir):
    """mlx-lm's own generate() and stream_generate() accept the drop-in caches and give stock's text."""
    from registry.integrations.mlx_lm import make_prompt_cache

    model, tok = cli.load_local(model_dir)
    stock = import_mlx_lm_module("cache")
    want = mlx_lm_generate.generate(model, tok, "hello the world", max_tokens=6,
                                    prompt_cache=stock.make_prompt_cache(model))
    assert mlx_lm_generate.generate(model, tok, "hello the world", max_tokens=6,
                                    prompt_cache=make_prompt_cache(model)) == want
    streamed = "".join(r.text for r in mlx_lm_generate.stream_generate(model, tok, "hello the world", max_tokens=6,
                                                                       prompt_cache=make_prompt_cache(model)))
    assert streamed == want and len(want.split()) >= 3
