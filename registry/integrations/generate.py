"""`python -m registry.integrations.generate`: mlx-lm's own generate loop with the fused caches.

    python -m registry.integrations.generate --model <dir-or-arch> --prompt "..." --max-tokens N

--model is a local mlx-lm model directory (config.json + model*.safetensors, with its tokenizer
when the directory has one; nothing is ever downloaded) or an architecture of docs/coverage.md
(or its first word), which builds a random-weight model. Runs mlx-lm's generate_step with
`prompt_cache=make_prompt_cache(model)` (registry/integrations/mlx_lm_cache.py), prints which
layers run fused, the tokens (and text, with a tokenizer) and the prompt / generation tokens-per-sec
and peak memory as mlx-lm's generate does. --stock runs mlx-lm's own caches instead; --check runs
both and fails unless the tokens are identical. Without a tokenizer the prompt's UTF-8 bytes,
modulo the vocabulary size, are the prompt tokens.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ModelLoadError(ValueError):
    """The --model argument cannot be loaded; the message names the path or name and why."""


def _arch_names() -> dict[str, str]:
    """--model spellings of architectures: the coverage table's names and their first word."""
    from .engine import _names

    return _names()


def check_model_dir(path: Path) -> dict:
    """The directory's config, or ModelLoadError naming the file and what is wrong."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (an mlx-lm model directory holds config.json and "
                             f"model*.safetensors)")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_file}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{cfg_file}: field 'model_type' missing or not a string")
    from .mlx_lm import MODEL_REMAPPING, import_mlx_lm_module

    name = MODEL_REMAPPING.get(model_type, model_type)
    import_mlx_lm_module("cache")                       # makes sure the mlx_lm package is importable
    if not name.replace("_", "").isalnum() or importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
        raise ModelLoadError(f"{cfg_file}: field 'model_type': {model_type!r} is not an mlx-lm 0.32.2 "
                             f"architecture (no mlx_lm/models/{name}.py)")
    if not list(path.glob("model*.safetensors")):
        raise ModelLoadError(f"{path}: no model*.safetensors weight files")
    return config


def load_local(path: Path):
    """(model, tokenizer or None) from a local mlx-lm model directory; never downloads."""
    check_model_dir(path)
    try:
        utils = importlib.import_module("mlx_lm.utils")
    except ImportError as e:
        raise ModelLoadError(f"{path}: loading a model directory needs mlx-lm's full install ({e})") from None
    try:
        model, _ = utils.load_model(path)
    except (ValueError, KeyError, TypeError, FileNotFoundError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: mlx-lm cannot load this model ({type(e).__name__}: {e})") from None
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = utils.load_tokenizer(path)
        except Exception as e:  # a broken tokenizer file must not hide the model: say it, run without
            print(f"warning: {path}: tokenizer not loaded ({type(e).__name__}: {e}); using byte tokens",
                  file=sys.stderr)
    return model, tokenizer


def load(spec: str, dtype: str):
    """(model, tokenizer or None, description) for --model: a directory or an architecture name."""
    path = Path(spec)
    if path.is_dir():
        model, tok = load_local(path)
        return model, tok, f"{path} ({'with' if tok is not None else 'no'} tokenizer)"
    names = _arch_names()
    if spec in names:
        from .coverage import ARCHS
        from .mlx_lm import build_model

        mx.random.seed(0)
        return build_model(ARCHS[names[spec]], dtype=getattr(mx, dtype)), None, f"{names[spec]} ({dtype}, random weights)"
    if path.exists():
        raise ModelLoadError(f"--model {spec}: not a directory")
    raise ModelLoadError(f"--model {spec!r}: no such directory, and not an architecture name (one of: "
                         f"{', '.join(sorted(names))})")


def vocab_size(model) -> int:
    from .slot_engine import _vocab_size

    v = _vocab_size(model)
    if v is None:
        raise ModelLoadError(f"{type(model).__name__}: cannot find vocab_size in the model's args")
    return v


def run(model, prompt: list[int], max_tokens: int, cache) -> dict:
    """mlx-lm's generate_step; timing as mlx-lm's generate reports it (prompt: up to the first
    token; generation: the rest)."""
    gen = importlib.import_module("mlx_lm.generate")
    mx.reset_peak_memory()
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for (tok, _), n in zip(gen.generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache),
                           range(max_tokens)):
        if n == 0:
            t_first = time.perf_counter()
        tokens.append(int(tok))
    t1 = time.perf_counter()
    n_gen = max(len(tokens) - 1, 0)
    return {"tokens": tokens, "prompt_tps": len(prompt) / max(t_first - t0, 1e-9),
            "generation_tps": n_gen / (t1 - t_first) if t1 > t_first and n_gen else 0.0,
            "prefill_s": t_first - t0, "decode_s": t1 - t_first, "decode_tokens": n_gen,
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


def decode_benchmark(model, prompts: list[list[int]], max_tokens: int, *, fused: bool = True,
                     max_kv_size: int | None = None) -> dict:
    """The end-to-end benchmark's `mlx_lm_fused_cache` mode (fused=True) and its stock `mlx_lm`
    counterpart (fused=False): mlx-lm's own generate_step loop for one prompt, its BatchGenerator
    (BatchKVCache / BatchRotatingKVCache, merged from per-prompt caches) for several; caches from
    make_prompt_cache(model) or mlx-lm's own. Returns the tokens per prompt, prefill_s (until every
    prompt has its first token), decode_s, decode_tokens and decode_tokens_per_s."""
    from .mlx_lm import import_mlx_lm_module
    from .mlx_lm_cache import make_prompt_cache

    stock = import_mlx_lm_module("cache")

    def caches():
        return make_prompt_cache(model, max_kv_size) if fused else stock.make_prompt_cache(model, max_kv_size)

    if not prompts or max_tokens < 1:
        raise ValueError("decode_benchmark: needs at least one prompt and max_tokens >= 1")
    if len(prompts) == 1:
        r = run(model, prompts[0], max_tokens, caches())
        out = {"tokens": [r["tokens"]], **{k: r[k] for k in ("prefill_s", "decode_s", "decode_tokens")}}
    else:
        gen = importlib.import_module("mlx_lm.generate")
        B = len(prompts)
        g = gen.BatchGenerator(model, stop_tokens=[], max_tokens=max_tokens, completion_batch_size=B,
                               prefill_batch_size=B, max_kv_size=max_kv_size)
        t0 = time.perf_counter()
        uids = g.insert(prompts, [max_tokens] * B, caches=[caches() for _ in prompts])
        toks: dict[int, list[int]] = {u: [] for u in uids}
        t_first = None
        while responses := g.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    toks[r.uid].append(r.token)
            if t_first is None and all(toks.values()):
                t_first = time.perf_counter()
        t1 = time.perf_counter()
        g.close()
        t_first = t_first or t1
        out = {"tokens": [toks[u] for u in uids], "prefill_s": t_first - t0, "decode_s": t1 - t_first,
               "decode_tokens": sum(len(t) for t in toks.values()) - B}
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_s"] if out["decode_s"] > 0 else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m registry.integrations.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local mlx-lm model directory, or an architecture name")
    p.add_argument("--prompt", default="hello", help="prompt text")
    p.add_argument("--max-tokens", "-m", type=int, default=32, help="tokens to generate")
    p.add_argument("--max-kv-size", type=int, default=None, help="as mlx-lm's: a RotatingKVCache of this size "
                                                                  "for models without their own make_cache")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="random-weight models only")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="mlx-lm's own caches (no fused kernel)")
    mode.add_argument("--check", action="store_true", help="also run mlx-lm's own caches; fail unless the tokens match")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_kv_size is not None and args.max_kv_size < 1:
        p.error(f"--max-kv-size must be >= 1, got {args.max_kv_size}")
    if not args.prompt:
        p.error("--prompt must not be empty")
    if not args.model:
        p.error("--model must not be empty")   # Path("") is the current directory

    from ..errors import MlxAotError
    from .mlx_lm import import_mlx_lm_module
    from .mlx_lm_cache import fused_model, make_prompt_cache

    try:
        model, tokenizer, what = load(args.model, args.dtype)
        if tokenizer is not None:
            prompt = list(tokenizer.encode(args.prompt))
            if not prompt:
                raise ModelLoadError(f"--prompt {args.prompt!r}: the tokenizer encodes it to no tokens")
        else:
            v = vocab_size(model)
            prompt = [b % v for b in args.prompt.encode("utf-8")]
        stock = import_mlx_lm_module("cache")
        print(f"model: {what} on {mx.default_device()}")
        if args.stock:
            cache = stock.make_prompt_cache(model, args.max_kv_size)
            print("caches: mlx-lm's own (--stock)")
        else:
            cache = make_prompt_cache(model, args.max_kv_size)
            print(fused_model(model).explain())
        out = run(model, prompt, args.max_tokens, cache)
    except (MlxAotError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("=" * 10)
    print(tokenizer.decode(out["tokens"]) if tokenizer is not None else f"tokens: {out['tokens']}")
    print("=" * 10)
    print(f"Prompt: {len(prompt)} tokens, {out['prompt_tps']:.3f} tokens-per-sec")
    print(f"Generation: {len(out['tokens'])} tokens, {out['generation_tps']:.3f} tokens-per-sec")
    print(f"Peak memory: {out['peak_memory_gb']:.3f} GB")
    if args.check:
        want = run(model, prompt, args.max_tokens, stock.make_prompt_cache(model, args.max_kv_size))
        if want["tokens"] != out["tokens"]:
            print(f"check: tokens differ from mlx-lm's own caches: {want['tokens']}", file=sys.stderr)
            return 1
        print(f"check: identical to mlx-lm's own caches ({want['generation_tps']:.3f} tokens-per-sec there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
