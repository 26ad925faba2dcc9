"""`python -m registry.integrations.generate` (console script `mlx-aot-generate`): mlx-lm's
`mlx_lm.generate` command with the drop-in caches (registry/integrations/mlx_lm_cache.py).

    mlx-aot-generate --model <dir-or-arch> --prompt "..." [--max-tokens N] [--check]

Same flags, defaults and output as mlx-lm 0.32.2's `mlx_lm.generate` for what it shares with it:
the tokenizer's chat template (--system-prompt, --prefill-response, --ignore-chat-template,
--chat-template-config), generation stops at the tokenizer's EOS (--extra-eos-token), sampling by
mlx-lm's make_sampler (--temp, --top-p, --min-p, --top-k, --min-tokens-to-keep, --xtc-probability,
--xtc-threshold, --seed), --max-kv-size, --prefill-step-size, --kv-bits, --kv-group-size,
--quantized-kv-start passed to mlx-lm's generate_step as mlx-lm passes them, and --verbose (the
text as it is generated, then the Prompt / Generation / Peak memory lines; False: the text only).
The generation is mlx-lm's own stream_generate with `prompt_cache=make_prompt_cache(model,
max_kv_size)`, so in float32 with greedy sampling the text is mlx-lm's.

--model is a local mlx-lm model directory (config.json + model*.safetensors, its tokenizer when the
directory has one; nothing is ever downloaded) or an architecture of docs/coverage.md (or its first
word), which builds a random-weight model; without a tokenizer the prompt's UTF-8 bytes, modulo the
vocabulary size, are the prompt tokens and the tokens are printed. --dtype casts the model's
floating-point weights (a directory's too; default: the directory's own dtype, float32 for an
architecture). --stock runs mlx-lm's own caches instead. --check also runs mlx-lm's own caches and
reports the first token where the two differ, the teacher-forced logit gap there and mlx-lm's top-2
margin there; it exits 1 unless the tokens are identical or, in bf16/fp16, the gap is within
docs/engine.md's tolerance (tolerance.HALF_LOGIT_TOL). Not supported: mlx-lm's --adapter-path,
--draft-model, --prompt-cache-file, --image, --quantize-activations, --trust-remote-code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_DTYPES = ("float32", "bfloat16", "float16")


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
    """(model, tokenizer or None) from a local mlx-lm model directory, read as mlx-lm's load() reads
    it (the tokenizer's EOS ids include config.json's eos_token_id); never downloads."""
    check_model_dir(path)
    try:
        utils = importlib.import_module("mlx_lm.utils")
    except ImportError as e:
        raise ModelLoadError(f"{path}: loading a model directory needs mlx-lm's full install ({e})") from None
    try:
        model, config = utils.load_model(path)
    except (ValueError, KeyError, TypeError, FileNotFoundError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: mlx-lm cannot load this model ({type(e).__name__}: {e})") from None
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = utils.load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        except Exception as e:  # a broken tokenizer file must not hide the model: say it, run without
            print(f"warning: {path}: tokenizer not loaded ({type(e).__name__}: {e}); using byte tokens",
                  file=sys.stderr)
    return model, tokenizer


def model_dtype(model) -> str:
    """The dtype name of the model's first floating-point parameter (a quantized model's scales)."""
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).rsplit(".", 1)[-1]
    return "float32"


def load(spec: str, dtype: str | None = None):
    """(model, tokenizer or None, description) for --model: a directory or an architecture name.
    dtype casts the model's floating-point weights (None: a directory's own dtype, float32 for an
    architecture)."""
    path = Path(spec)
    if path.is_dir():
        model, tok = load_local(path)
        if dtype is not None:
            model.set_dtype(getattr(mx, dtype))
        return model, tok, f"{path} ({'with' if tok is not None else 'no'} tokenizer, {model_dtype(model)})"
    names = _arch_names()
    if spec in names:
        from .coverage import ARCHS
        from .mlx_lm import build_model

        dtype = dtype or "float32"
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


def run(model, prompt: list[int], max_tokens: int, cache, **kwargs) -> dict:
    """mlx-lm's generate_step (kwargs: its sampler, max_kv_size, kv_bits, ...); timing as mlx-lm's
    stream_generate reports it (prompt: up to the first token; generation: tokens over the time after it)."""
    gen = importlib.import_module("mlx_lm.generate")
    mx.reset_peak_memory()
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for (tok, _), n in zip(gen.generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                                             **kwargs), range(max_tokens)):
        if n == 0:
            t_first = time.perf_counter()
        tokens.append(int(tok))
    t1 = time.perf_counter()
    return {"tokens": tokens, "prompt_tps": len(prompt) / max(t_first - t0, 1e-9),
            "generation_tps": len(tokens) / (t1 - t_first) if t1 > t_first else 0.0,
            "prefill_s": t_first - t0, "decode_s": t1 - t_first, "decode_tokens": max(len(tokens) - 1, 0),
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


@dataclass
class Generated:
    tokens: list[int]            # every generated token, the EOS that stopped it included
    text: str | None             # None without a tokenizer
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float


def generate(model, tokenizer, prompt: list[int], max_tokens: int, cache, *, echo: bool = False,
             **kwargs) -> Generated:
    """With a tokenizer mlx-lm's stream_generate (it stops at the tokenizer's EOS; echo prints the
    text as it comes, as mlx-lm's generate(verbose=True)), else generate_step. kwargs go to mlx-lm."""
    if tokenizer is None:
        r = run(model, prompt, max_tokens, cache, **kwargs)
        return Generated(r["tokens"], None, len(prompt), r["prompt_tps"], r["generation_tps"], r["peak_memory_gb"])
    gen = importlib.import_module("mlx_lm.generate")
    tokens, text, last = [], [], None
    for last in gen.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache, **kwargs):
        tokens.append(last.token)          # each token once: the final response carries the EOS or the last token
        text.append(last.text)
        if echo:
            print(last.text, end="", flush=True)
    return Generated(tokens, "".join(text), last.prompt_tokens, last.prompt_tps, last.generation_tps, last.peak_memory)


def teacher_forced_logits(model, prompt: list[int], tokens: list[int], cache, **kwargs) -> tuple[np.ndarray, str]:
    """The logits before each of `tokens` ([len(tokens), V] as float32) and their dtype, when mlx-lm's
    generate_step is fed exactly these tokens: the same prefill chunks, decode steps and KV
    quantization as a generation (kwargs: generate_step's, less the sampler), so a step is compared
    as it ran."""
    gen = importlib.import_module("mlx_lm.generate")
    rows: list[mx.array] = []

    def record(_, logits):
        rows.append(logits)
        return logits

    def forced(_):                         # called right after record, once per step
        return mx.array([tokens[min(len(rows), len(tokens)) - 1]])

    kwargs = {k: v for k, v in kwargs.items() if k != "sampler"}
    for _ in gen.generate_step(mx.array(prompt), model, max_tokens=len(tokens), prompt_cache=cache, sampler=forced,
                               logits_processors=[record], **kwargs):
        pass
    logits = mx.concatenate(rows[:len(tokens)], axis=0)
    return np.array(logits.astype(mx.float32)), str(logits.dtype).rsplit(".", 1)[-1]


@dataclass
class Divergence:
    """The first generated token where the drop-in caches and mlx-lm's own differ, with the logits
    of that step teacher-forced on mlx-lm's tokens."""
    step: int
    want: int                    # mlx-lm's own caches' token
    got: int                     # the drop-in caches' token
    gap: float                   # max |logit difference| at that step
    scale: float                 # max |logit| of mlx-lm's logits there
    margin: float                # mlx-lm's top-2 logit margin there
    dtype: str

    @property
    def tolerance(self) -> float | None:
        """The documented bound on the gap (docs/engine.md): HALF_LOGIT_TOL x max |logit| in bf16 and
        fp16, where the kernel's rounding point differs from mlx-lm's; float32 tokens are identical."""
        from .tolerance import HALF_LOGIT_TOL

        return HALF_LOGIT_TOL * self.scale if self.dtype in ("bfloat16", "float16") else None

    @property
    def within_tolerance(self) -> bool:
        return self.tolerance is not None and self.gap <= self.tolerance


def first_divergence(model, prompt: list[int], got: list[int], want: list[int], fused_cache, stock_cache,
                     **kwargs) -> Divergence | None:
    """None when the token lists are identical. Both runs stop at the same EOS set and max_tokens, so
    lists that differ differ at a position both have."""
    if got == want:
        return None
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    ours, _ = teacher_forced_logits(model, prompt, want[:j + 1], fused_cache, **kwargs)
    theirs, dtype = teacher_forced_logits(model, prompt, want[:j + 1], stock_cache, **kwargs)
    a, b = ours[j], theirs[j]
    top2 = np.sort(b)[-2:]
    return Divergence(j, want[j], got[j], float(np.abs(a - b).max()), float(np.abs(b).max()),
                      float(top2[1] - top2[0]), dtype)


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


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's flags that apply here, with its names and defaults (its own constants), and
    --dtype, --stock, --check."""
    from .tolerance import HALF_LOGIT_TOL

    g = importlib.import_module("mlx_lm.generate")
    p = argparse.ArgumentParser(prog="mlx-aot-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local mlx-lm model directory, or an architecture name")
    p.add_argument("--prompt", "-p", default=g.DEFAULT_PROMPT, help="message to the model ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--prefill-response", default=None, help="start of the response, for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="the raw prompt, without the chat template")
    p.add_argument("--chat-template-config", default=None,
                   help="JSON object of extra arguments to the tokenizer's apply_chat_template")
    p.add_argument("--extra-eos-token", default=(), nargs="+", help="more tokens that stop generation")
    p.add_argument("--max-tokens", "-m", type=int, default=g.DEFAULT_MAX_TOKENS,
                   help="maximum number of tokens to generate (-1: until EOS)")
    p.add_argument("--temp", type=float, default=g.DEFAULT_TEMP, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=g.DEFAULT_TOP_P, help="sampling top-p")
    p.add_argument("--min-p", type=float, default=g.DEFAULT_MIN_P, help="sampling min-p")
    p.add_argument("--top-k", type=int, default=g.DEFAULT_TOP_K, help="sampling top-k (0: off)")
    p.add_argument("--min-tokens-to-keep", type=int, default=g.DEFAULT_MIN_TOKENS_TO_KEEP,
                   help="minimum tokens kept by min-p sampling")
    p.add_argument("--xtc-probability", type=float, default=g.DEFAULT_XTC_PROBABILITY,
                   help="probability of XTC sampling at each token")
    p.add_argument("--xtc-threshold", type=float, default=g.DEFAULT_XTC_THRESHOLD, help="XTC threshold")
    p.add_argument("--seed", type=int, default=g.DEFAULT_SEED, help="PRNG seed")
    p.add_argument("--verbose", type=g.str2bool, default=True,
                   help="'False' or 'F': print only the response; otherwise also the timing lines")
    p.add_argument("--max-kv-size", type=int, default=None, help="maximum KV cache size (a rotating cache)")
    p.add_argument("--prefill-step-size", type=int, default=g.DEFAULT_PREFILL_STEP_SIZE,
                   help="prompt tokens processed at a time")
    p.add_argument("--kv-bits", type=int, default=None, choices=[1, 2, 3, 4, 5, 6, 8],
                   help="bits of KV cache quantization (default: none)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128],
                   help="group size of KV cache quantization")
    p.add_argument("--quantized-kv-start", type=int, default=g.DEFAULT_QUANTIZED_KV_START,
                   help="with --kv-bits: quantize the KV cache from this step on")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="cast the model's floating-point weights (default: a directory's own dtype; "
                        "float32 for an architecture)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="mlx-lm's own caches (no fused kernel)")
    mode.add_argument("--check", action="store_true",
                      help="also run mlx-lm's own caches and report where the tokens differ; exit 1 unless "
                           f"identical or, in bf16/fp16, within the documented tolerance ({HALF_LOGIT_TOL} x max |logit|)")
    return p


def _validate(p: argparse.ArgumentParser, args) -> None:
    """Usage errors (exit 2) naming the flag and what it takes."""
    ranges = [("--max-tokens", args.max_tokens, args.max_tokens >= 1 or args.max_tokens == -1, ">= 1, or -1 (until EOS)"),
              ("--temp", args.temp, args.temp >= 0, ">= 0"),
              ("--top-p", args.top_p, 0 <= args.top_p <= 1, "in [0, 1]"),
              ("--min-p", args.min_p, 0 <= args.min_p <= 1, "in [0, 1]"),
              ("--top-k", args.top_k, args.top_k >= 0, ">= 0"),
              ("--min-tokens-to-keep", args.min_tokens_to_keep, args.min_tokens_to_keep >= 1, ">= 1"),
              ("--xtc-probability", args.xtc_probability, 0 <= args.xtc_probability <= 1, "in [0, 1]"),
              ("--xtc-threshold", args.xtc_threshold, 0 <= args.xtc_threshold <= 0.5, "in [0, 0.5]"),
              ("--max-kv-size", args.max_kv_size, args.max_kv_size is None or args.max_kv_size >= 1, ">= 1"),
              ("--prefill-step-size", args.prefill_step_size, args.prefill_step_size >= 1, ">= 1"),
              ("--quantized-kv-start", args.quantized_kv_start, args.quantized_kv_start >= 0, ">= 0")]
    for flag, value, ok, expected in ranges:
        if not ok:
            p.error(f"{flag} must be {expected}, got {value}")
    if not args.prompt:
        p.error("--prompt must not be empty")
    if not args.model:
        p.error("--model must not be empty")   # Path("") is the current directory
    if args.chat_template_config is not None:
        try:
            args.chat_template_config = json.loads(args.chat_template_config)
        except json.JSONDecodeError as e:
            p.error(f"--chat-template-config must be a JSON object, got {args.chat_template_config!r} ({e})")
        if not isinstance(args.chat_template_config, dict):
            p.error(f"--chat-template-config must be a JSON object, got {type(args.chat_template_config).__name__}")
    if args.check and args.temp > 0 and args.seed is None:
        p.error("--check with --temp > 0 needs --seed: both runs must draw the same random numbers")


def encode_prompt(tokenizer, args) -> tuple[list[int], bool]:
    """The prompt tokens as mlx_lm.generate's main() makes them, and whether the chat template applied."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=has_prefill,
                                               add_generation_prompt=not has_prefill,
                                               **(args.chat_template_config or {}))
    return list(tokenizer.encode(prompt, add_special_tokens=not use_chat_template)), use_chat_template


def _print_stats(g: Generated) -> None:
    """mlx-lm's generate(verbose=True) lines."""
    print(f"Prompt: {g.prompt_tokens} tokens, {g.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {len(g.tokens)} tokens, {g.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {g.peak_memory_gb:.3f} GB")


def _token_text(tokenizer, t: int) -> str:
    return f"{t} {tokenizer.decode([t])!r}" if tokenizer is not None else str(t)


def _report(d: Divergence, tokenizer) -> bool:
    """Print --check's report of a divergence; True when it is within the documented tolerance."""
    from .tolerance import HALF_LOGIT_TOL

    print(f"check: first difference at generated token {d.step}: mlx-lm's own caches "
          f"{_token_text(tokenizer, d.want)}, drop-in {_token_text(tokenizer, d.got)}")
    print(f"check: teacher-forced on mlx-lm's tokens, at that step ({d.dtype} logits): max |logit difference| "
          f"{d.gap:.4g} = {d.gap / d.scale:.4f} x max |logit| ({d.scale:.4g}); mlx-lm's top-2 margin {d.margin:.4g}")
    if d.within_tolerance:
        print(f"check: within the documented {d.dtype} tolerance ({HALF_LOGIT_TOL} x max |logit| = "
              f"{d.tolerance:.4g}, docs/engine.md): the kernel rounds q and k once, mlx-lm's rope rounds "
              f"differently, and differences of this size flip a token whose top-2 margin is below twice "
              f"them ({2 * d.gap:.4g})")
        return True
    if d.tolerance is None:
        print(f"check: FAILED: {d.dtype} tokens must be identical to mlx-lm's (docs/engine.md); a tolerance "
              f"applies to bfloat16 and float16 only", file=sys.stderr)
    else:
        print(f"check: FAILED: the gap is above the documented {d.dtype} tolerance ({HALF_LOGIT_TOL} x max "
              f"|logit| = {d.tolerance:.4g}, docs/engine.md)", file=sys.stderr)
    return False


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _validate(p, args)

    from ..errors import MlxAotError
    from .mlx_lm import import_mlx_lm_module
    from .mlx_lm_cache import fused_model, make_prompt_cache

    stock = import_mlx_lm_module("cache")
    sample_utils = importlib.import_module("mlx_lm.sample_utils")
    from_dir = Path(args.model).is_dir()
    if args.seed is not None and from_dir:
        mx.random.seed(args.seed)          # before loading, as mlx-lm: building a model draws random numbers
    try:
        model, tokenizer, what = load(args.model, args.dtype)
        if args.seed is not None and not from_dir:
            mx.random.seed(args.seed)      # an architecture's weights are drawn from seed 0
        if tokenizer is not None:
            for t in args.extra_eos_token:
                tokenizer.add_eos_token(t)
            prompt, templated = encode_prompt(tokenizer, args)
            if not prompt:
                raise ModelLoadError(f"--prompt {args.prompt!r}: the tokenizer encodes it to no tokens")
        else:
            if args.max_tokens == -1:
                raise ModelLoadError(f"--max-tokens -1 (until EOS): {args.model} has no tokenizer, so no EOS")
            v = vocab_size(model)
            prompt, templated = [b % v for b in args.prompt.encode("utf-8")], False
    except (MlxAotError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.system_prompt is not None and not templated:
        print("warning: --system-prompt is unused: no chat template applies (as in mlx-lm)", file=sys.stderr)
    special = (tokenizer.encode("\n") + list(tokenizer.eos_token_ids)) if tokenizer is not None else []
    kwargs = dict(sampler=sample_utils.make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep,
                                                    top_k=args.top_k, xtc_probability=args.xtc_probability,
                                                    xtc_threshold=args.xtc_threshold, xtc_special_tokens=special),
                  max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size, kv_bits=args.kv_bits,
                  kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start)

    def caches(own: bool):
        return stock.make_prompt_cache(model, args.max_kv_size) if own else make_prompt_cache(model, args.max_kv_size)

    def generation(own: bool, echo: bool) -> Generated:
        if args.check and args.temp > 0:
            mx.random.seed(args.seed)      # both runs of --check draw the same numbers
        return generate(model, tokenizer, prompt, args.max_tokens, caches(own), echo=echo, **kwargs)

    try:
        if args.verbose:
            print(f"model: {what} on {mx.default_device()}")
            print("caches: mlx-lm's own (--stock)" if args.stock else fused_model(model).explain())
            print("=" * 10)
        out = generation(args.stock, echo=args.verbose and tokenizer is not None)
        if args.verbose:
            if tokenizer is None:
                print(f"tokens: {out.tokens}", end="")
            print()
            print("=" * 10)
            if out.text == "":
                print("No text generated for this prompt")
            else:
                _print_stats(out)
        else:
            print(out.text if tokenizer is not None else f"tokens: {out.tokens}")
        if not args.check:
            return 0
        want = generation(True, echo=False)
        d = first_divergence(model, prompt, out.tokens, want.tokens, caches(False), caches(True), **kwargs)
    except (MlxAotError, ValueError, NotImplementedError) as e:
        msg = f"{type(e).__name__}: {e}"
        if args.kv_bits is not None and (isinstance(e, NotImplementedError) or "quantiz" in str(e)):
            # mlx-lm quantizes a cache once its offset reaches --quantized-kv-start: rotating caches
            # (sliding windows, --max-kv-size) cannot be, and head_dim must divide into groups
            msg = (f"--kv-bits {args.kv_bits} --kv-group-size {args.kv_group_size}: mlx-lm cannot quantize "
                   f"this model's KV cache ({msg})")
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if d is None:
        print(f"check: identical to mlx-lm's own caches ({len(want.tokens)} tokens, {want.generation_tps:.3f} "
              f"tokens-per-sec there)")
        return 0
    return 0 if _report(d, tokenizer) else 1


if __name__ == "__main__":
    sys.exit(main())
