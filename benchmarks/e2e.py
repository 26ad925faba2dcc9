"""End-to-end greedy decode on real-size mlx-lm models with random weights: mlx-lm's own loop, the
slot engine in each mode, and mlx-lm's loop on the project's drop-in cache (`bench --e2e`).

Each cell (size, dtype, batch, prompt length) builds `batch` random prompts (in a batch, the nominal
length for half the rows and three quarters of it for the other half, as a server's prompts differ:
the batch caches' left padding is real), runs every mode once
untimed (short), then `rounds` timed rounds, the modes round-robin inside each round (a transient
slowdown of the host hits every mode alike), and keeps the median per mode. A run is timed from the
first model call to the first generated token of every request (prefill) and from there to the
last token (decode: batch x (decode_tokens - 1) tokens).

Every cell records `floor_tokens_per_s`: the batch's tokens per decode step over the time one step
needs at least, its bytes (the weights a step reads: every parameter, less the embedding table where
the output head is a separate matrix, plus each layer's K/V rows at the middle of the decode, a
sliding layer's at most its window) at the copy bandwidth measured in the same run
(`copy_bandwidth`: a 2 GiB device copy, read + write).

What each mode runs (mlx-lm 0.32.2's own loops, not a copy of them):
  - mlx_lm: batch 1 through `mlx_lm.generate.generate_step` (what `generate`/`stream_generate`
    run: its own `make_prompt_cache`, `mx.async_eval` pipelining); batch > 1 through
    `BatchGenerator` (what `batch_generate` runs), with prefill_batch_size = completion_batch_size
    = batch so that every request is prefilled in one batch and decoded together;
  - module / reference / fused: `SlotEngine(model, mode=...)`, every request admitted at once;
  - mlx_lm_fused_cache: the same mlx-lm loops on `registry.integrations.mlx_lm.make_prompt_cache`,
    one cache list per request (skipped, with the reason, where that is not importable).

With kv_bits (`--kv-bits 8,4`), each of mlx-lm's modes runs again on a quantized cache, every variant
in the same rounds as the float ones: mlx_lm through generate_step(kv_bits=, kv_group_size=,
quantized_kv_start=0) (mlx-lm's own QuantizedKVCache from the first decode step; its prompt is
prefilled on the float cache, which it then converts), mlx_lm_fused_cache on make_prompt_cache(model,
kv_bits=, kv_group_size=) per request (quantized from the first token; at batch > 1 BatchGenerator
merges them into the drop-in's BatchQuantizedKVCache). A variant that cannot run (stock at batch > 1:
mlx-lm's BatchGenerator takes no kv_bits and its QuantizedKVCache has no merge; stock's
RotatingKVCache cannot quantize; a kernel MLX lacks) is skipped with the reason. The slot engine has
float pools only.

Every cell records its KV memory: `kv_peak_bytes`, the peak of MLX's active memory over the run
less the memory active when it started (the weights, and anything alive between runs: another engine
mode's pools; an engine mode's own pools are counted), so the cache's buffers plus the run's
transient arrays (activations, logits, prefill's attention scores); `kv_decode_peak_bytes`, the same
from the first generated token on (prefill's transients left out); `kv_cache_bytes`, the nbytes of
the cache's buffers at the end of the decode (a batch: before its last step, after which
BatchGenerator drops them).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from registry.integrations.tolerance import HALF_LOGIT_TOL as BF16_LOGIT_TOL  # docs/engine.md's bound

from .cases import BenchmarkError

MODES = ("mlx_lm", "module", "reference", "fused", "mlx_lm_fused_cache")
ENGINE_MODES = ("module", "reference", "fused")
QUANT_MODES = ("mlx_lm", "mlx_lm_fused_cache")    # the modes with a quantized cache (SlotEngine: float pools only)
KV_BITS = (None, 8, 4)                           # None: the float cache
KV_GROUP_SIZES, KV_GROUP_SIZE = (32, 64, 128), 64
DTYPES = ("bfloat16", "float16", "float32")
BATCHES, PROMPTS, DECODE_TOKENS, ROUNDS = (1, 8, 32), (128, 2048), 64, 3
# The CPU's defaults: a 2-core machine prefills a 2048-token prompt of even the tiny sizes in tens of
# seconds (bf16/f16 matmuls are not native there), so its cells are shorter.
CPU_DTYPES, CPU_BATCHES, CPU_PROMPTS, CPU_DECODE_TOKENS = ("bfloat16",), (1, 8), (32, 128), 32
WARMUP_TOKENS, WARMUP_MAX_PROMPT = 3, 128     # the untimed run per mode: short, same batch
MLX_LM_PREFILL_STEP = 2048                    # BatchGenerator's default prefill_step_size (mlx-lm 0.32.2)
CHECK_PROMPT, CHECK_TOKENS, CHECK_BATCH = 12, 8, 2
NEAR_TIE = 1e-3                                # float32: a token may flip where mlx-lm's top-2 gap is this close

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Size:
    name: str
    config: dict
    check_layers: int          # the agreement check runs the config cut to this many layers
    note: str
    cpu: bool = False          # small enough for a 2-core CPU


def _llama(layers, hidden, heads, kv, head_dim, inter, vocab, tie, **kw):
    return dict(model_type="llama", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3,
                max_position_embeddings=131072, **kw)


def _qwen3(layers, hidden, heads, kv, head_dim, inter, vocab):
    return dict(model_type="qwen3", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960)


def _gemma3(layers, hidden, heads, kv, head_dim, inter, vocab, window, pattern):
    return dict(model_type="gemma3_text", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                sliding_window=window, sliding_window_pattern=pattern, query_pre_attn_scalar=head_dim,
                rope_theta=1e6, rope_local_base_freq=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)


SIZES: dict[str, Size] = {s.name: s for s in (
    Size("llama-8b", _llama(32, 4096, 32, 8, 128, 14336, 128256, False), 2,
         "Llama-3.1-8B dims: 32 layers, hidden 4096, 32/8 heads, head_dim 128, llama3 RoPE"),
    Size("llama-1b", _llama(16, 2048, 32, 8, 64, 8192, 128256, True), 2,
         "Llama-3.2-1B dims: 16 layers, hidden 2048, 32/8 heads, head_dim 64, llama3 RoPE, tied head"),
    Size("qwen3-1.7b", _qwen3(28, 2048, 16, 8, 128, 6144, 151936), 2,
         "Qwen3-1.7B dims: 28 layers, hidden 2048, 16/8 heads, head_dim 128, q/k RMSNorm"),
    Size("gemma3-1b", _gemma3(26, 1152, 4, 1, 256, 6912, 262144, 512, 6), 6,
         "Gemma-3-1B dims: 26 layers (5 sliding of window 512 : 1 global), hidden 1152, 4/1 heads, head_dim 256"),
    Size("tiny-llama", _llama(4, 256, 8, 2, 32, 512, 4096, True), 4,
         "CPU size: 4 layers, hidden 256, 8/2 heads, head_dim 32, llama3 RoPE", cpu=True),
    Size("tiny-qwen3", _qwen3(4, 256, 8, 4, 32, 512, 4096), 4,
         "CPU size: 4 layers, hidden 256, 8/4 heads, head_dim 32, q/k RMSNorm", cpu=True),
    Size("tiny-gemma3", _gemma3(6, 256, 4, 1, 64, 512, 4096, 64, 3), 6,
         "CPU size: 6 layers (2 sliding of window 64 : 1 global), hidden 256, 4/1 heads, head_dim 64", cpu=True),
)}
GPU_SIZES = ("llama-8b", "llama-1b", "qwen3-1.7b", "gemma3-1b")
# The long-context cells of the decode-attention work (docs/benchmarks/README.md): bench --sizes selects them.
SIZES.update({s.name: s for s in (
    Size("qwen3-8b", _qwen3(36, 4096, 32, 8, 128, 12288, 151936), 2,
         "Qwen3-8B dims: 36 layers, hidden 4096, 32/8 heads, head_dim 128, q/k RMSNorm"),
    Size("gemma3-4b", _gemma3(34, 2560, 8, 4, 256, 10240, 262208, 1024, 6), 6,
         "Gemma-3-4B dims: 34 layers (5 sliding of window 1024 : 1 global), hidden 2560, 8/4 heads, head_dim 256"),
)})
CPU_SIZES = ("tiny-llama", "tiny-qwen3", "tiny-gemma3")


def random_model(config: dict, dtype):
    """An mlx-lm model of `config` with random weights made directly in `dtype` (matrices N(0, 1/(3
    fan_in)): the spread of mlx-lm's own uniform init, which the engine tests use; norms and other
    vectors keep the class's own init): the model class's own lazy
    initialisation is replaced before it is ever evaluated, so a 16 GB model costs 16 GB."""
    from mlx.utils import tree_flatten, tree_unflatten

    from registry.integrations.mlx_lm import MODEL_REMAPPING, import_mlx_lm_module

    arch = import_mlx_lm_module(MODEL_REMAPPING.get(config["model_type"], config["model_type"]))
    model = arch.Model(arch.ModelArgs.from_dict(config))
    new = [(k, mx.random.normal(v.shape, dtype=dtype) * ((3 * v.shape[-1]) ** -0.5) if v.ndim >= 2 else v.astype(dtype))
           for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def fused_cache_factory() -> tuple[Callable | None, str]:
    """(registry.integrations.mlx_lm.make_prompt_cache, "") or (None, why it is not available)."""
    try:
        from registry.integrations.mlx_lm import make_prompt_cache
    except ImportError as e:
        return None, f"registry.integrations.mlx_lm.make_prompt_cache is not importable ({e})"
    return make_prompt_cache, ""


# ----------------------------------------------------------------------------- one run per mode

def sync() -> None:
    """Wait for the default stream and mlx-lm's generation stream (its loops run there)."""
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)


@dataclass
class Run:
    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    logits: list[np.ndarray] | None = None
    kv_peak_bytes: int | None = None          # the module docstring's KV memory
    kv_decode_peak_bytes: int | None = None
    kv_cache_bytes: int | None = None


class _Memory:
    """A run's KV memory (the module docstring): `start` before the first model call, `first_token`
    when prefill is done, `end` once the last step has run. `own`: bytes of the mode that were alive
    before the run and are its KV (an engine's pools)."""

    def __init__(self, own: int = 0):
        self.base = mx.get_active_memory() - own
        self.prefill_peak = 0
        mx.reset_peak_memory()

    def first_token(self) -> None:
        self.prefill_peak = mx.get_peak_memory()
        mx.reset_peak_memory()

    def end(self, run: Run, cache_bytes: int | None) -> Run:
        decode = mx.get_peak_memory()
        run.kv_peak_bytes = max(self.prefill_peak, decode) - self.base
        run.kv_decode_peak_bytes = decode - self.base
        run.kv_cache_bytes = cache_bytes
        return run


def _prefill_kw(prefill_step_size: int | None) -> dict:
    """mlx-lm's prefill chunk when one is asked for, else its own default."""
    return {} if prefill_step_size is None else dict(prefill_step_size=prefill_step_size)


def _cache_bytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


def _mlx_lm_single(model, prompt: list[int], n: int, cache, prefill_step_size: int | None = None,
                   quantize: dict | None = None) -> Run:
    """generate_step on `cache`; quantize: its kv_bits, kv_group_size, quantized_kv_start (mlx-lm
    converts the cache list in place, so `cache` holds the quantized caches after)."""
    from mlx_lm.generate import generate_step

    toks = []
    mem = _Memory()
    t0 = time.perf_counter()
    t1 = t0
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n, prompt_cache=cache,
                                **_prefill_kw(prefill_step_size), **(quantize or {})):
        toks.append(int(tok))
        if len(toks) == 1:
            t1 = time.perf_counter()
            mem.first_token()
    t2 = time.perf_counter()
    sync()                         # generate_step queues one step past the last token it yields
    return mem.end(Run([toks], t1 - t0, t2 - t1), _cache_bytes(cache))


def _mlx_lm_batch(model, prompts: list[list[int]], n: int, caches, prefill_step_size: int | None = None) -> Run:
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=B, prefill_batch_size=B,
                         **_prefill_kw(prefill_step_size))
    try:
        uids = gen.insert(prompts, caches=caches)
        got: dict[int, list[int]] = {u: [] for u in uids}
        mem = _Memory()
        cache_bytes = None
        t0 = time.perf_counter()
        t1 = t2 = None
        start = window = 0
        counts = [0]
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(r.token)
            counts = [len(t) for t in got.values()]
            if t1 is None and min(counts) >= 1:
                t1, start = time.perf_counter(), sum(counts)
                mem.first_token()
            if t1 is not None and t2 is None and max(counts) >= n:
                t2, window = time.perf_counter(), sum(counts) - start
            if cache_bytes is None and min(counts) >= n - 1:   # the last step drops the batch
                cache_bytes = gen.prompt_cache_nbytes
    finally:
        gen.close()
    sync()
    # The shorter prompts decode while the longest still prefills (BatchGenerator runs one prefill
    # chunk and one decode step per call): time only the steps where every request decodes, scaled
    # to n - 1 of them, so that tokens/s is the whole batch's decode and not prefill's too. A run
    # with no such step keeps 0: the untimed warm-up (`bench --e2e` refuses too few decode tokens).
    decode_s = (t2 - t1) * len(prompts) * (n - 1) / window if window else 0.0
    return mem.end(Run([got[u] for u in uids], t1 - t0, decode_s), cache_bytes)


def batch_lag(lengths: list[int], prefill_step_size: int | None) -> int:
    """Decode steps that BatchGenerator runs for the shortest prompts before the longest's first token:
    one prefill chunk per call, a request decoding from the call after its last chunk."""
    step = prefill_step_size or MLX_LM_PREFILL_STEP
    chunks = [-(-(n - 1) // step) for n in lengths]
    return max(chunks) - min(chunks)


def run_mlx_lm(model, prompts, n, cache_factory, prefill_step_size: int | None = None,
               quantize: dict | None = None) -> Run:
    """mlx-lm's own loop on `cache_factory(model)` caches (one list per request: the quantized drop-in's
    too, which BatchGenerator merges); quantize: stock's generate_step(kv_bits=...) arguments (batch 1
    only: BatchGenerator takes none)."""
    if len(prompts) == 1:
        return _mlx_lm_single(model, prompts[0], n, cache_factory(model), prefill_step_size, quantize)
    if quantize:
        raise NotImplementedError("mlx-lm's BatchGenerator takes no kv_bits")
    return _mlx_lm_batch(model, prompts, n, [cache_factory(model) for _ in prompts], prefill_step_size)


def _pool_bytes(engine) -> int:
    return sum(a.nbytes for p in engine.pools.values() for a in (p.k_pool, p.v_pool) if a is not None)


def run_engine(engine, prompts, n) -> Run:
    """Every request admitted at once: the first step prefills them all and reads their first tokens."""
    rids = [engine.add_request(p, n) for p in prompts]
    mem = _Memory(own=_pool_bytes(engine))
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    mem.first_token()
    while engine.waiting or engine.running:     # the step that queues the last forward reads everything
        engine.step()
    t2 = time.perf_counter()
    reqs = [engine.requests.pop(rid) for rid in rids]
    logits = [np.stack(r.logits) for r in reqs] if engine.record_logits else None
    return mem.end(Run([r.generated for r in reqs], t1 - t0, t2 - t1, logits), _pool_bytes(engine))


@contextlib.contextmanager
def _stock_quantized_attention():
    """mlx-lm's own quantized attention for the block: the drop-in's wrapper of it (install_attention,
    which passes stock's keys through) taken out, so stock runs the function as shipped."""
    from registry.integrations.mlx_lm import import_mlx_lm_module

    base = import_mlx_lm_module("base")
    current = base.quantized_scaled_dot_product_attention
    if not getattr(current, "_mlx_aot_wrapped", False):
        yield
        return
    base.quantized_scaled_dot_product_attention = current.__wrapped__
    try:
        yield
    finally:
        base.quantized_scaled_dot_product_attention = current


@contextlib.contextmanager
def as_shipped(mode: str, model):
    """The context a mode of mlx-lm's own loop runs in: `mlx_lm` is stock mlx-lm exactly as shipped
    (mlx_lm_cache.stock_model: what the drop-in cache installed on the model taken out for the block,
    its rope switches and direct attention classes, then put back; its quantized attention too), the
    fused cache as it is."""
    from registry.integrations.mlx_lm_cache import stock_model

    if mode != "mlx_lm":
        yield model
        return
    with stock_model(model), _stock_quantized_attention():
        yield model


def stock_batch_quantize_reason() -> str | None:
    """Why stock mlx-lm cannot decode a batch on a quantized cache, or None if its BatchGenerator
    takes kv_bits (mlx-lm 0.32.2's does not, and its QuantizedKVCache has no merge)."""
    import inspect

    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    if "kv_bits" in inspect.signature(BatchGenerator.__init__).parameters:
        return None
    return (f"stock mlx-lm {mlx_lm.__version__} batches no quantized cache: its BatchGenerator takes no kv_bits "
            f"(and its QuantizedKVCache has no merge)")


Variant = tuple  # (mode, kv_bits): kv_bits None for the float cache


class Modes:
    """The modes of one model, each on the float cache and on each kv_bits asked for (`variants`):
    how to run each, and why a variant cannot run (`skipped`)."""

    def __init__(self, model, modes, pool_size: int, record_logits: bool = False, prefill_step_size: int | None = None,
                 kv_bits=(None,), kv_group_size: int = KV_GROUP_SIZE, head_dim: int | None = None):
        from registry.integrations.mlx_lm import build_kernel_sets, make_own_cache
        from registry.integrations.slot_engine import SlotEngine

        self.model = model
        self.prefill_step_size = prefill_step_size    # mlx-lm's loops only: the slot engine prefills whole
        self.kv_group_size = kv_group_size
        self.skipped: dict[Variant, str] = {}
        self.engines = {}
        self.implementation: dict[str, str] = {}
        bad = [m for m in modes if m not in QUANT_MODES]
        if any(b is not None for b in kv_bits) and bad:
            raise ValueError(f"Modes: {', '.join(bad)} have no quantized cache (the slot engine's pools are float)")
        kernels = build_kernel_sets(model) if any(m in ENGINE_MODES for m in modes) else None
        for m in modes:
            if m in ENGINE_MODES:
                e = SlotEngine(model, pool_size=pool_size, mode=m, kernels=kernels, record_logits=record_logits)
                self.engines[m] = e
                self.implementation[m] = ", ".join(sorted({f"{p.path}" + (f" ({p.reason.split(' ')[0]})"
                                                                          if p.path == "fused" else "")
                                                           for p in e.plans.values()}))
        self.factories = {"mlx_lm": make_own_cache}
        if "mlx_lm_fused_cache" in modes:
            factory, why = fused_cache_factory()
            if factory is None:
                self.skipped.update({("mlx_lm_fused_cache", b): why for b in kv_bits})
            else:
                self.factories["mlx_lm_fused_cache"] = factory
        for b in kv_bits:
            if b is not None and head_dim is not None and head_dim % kv_group_size:
                self.skipped.update({(m, b): f"head_dim {head_dim} is not a multiple of --kv-group-size "
                                             f"{kv_group_size} (mx.quantize groups a row's features)" for m in modes})
        self.variants = [(m, b) for b in kv_bits for m in modes if (m, b) not in self.skipped]

    @property
    def modes(self) -> list[str]:
        """The modes running on the float cache."""
        return [m for m, b in self.variants if b is None]

    def _quantize(self, bits: int | None) -> dict:
        return {} if bits is None else dict(kv_bits=bits, kv_group_size=self.kv_group_size)

    def run(self, mode: str, prompts, n, kv_bits: int | None = None) -> Run:
        if mode in self.engines:
            if kv_bits is not None:
                raise ValueError(f"mode {mode}: the slot engine has no quantized pools")
            return run_engine(self.engines[mode], prompts, n)
        if kv_bits is not None and mode == "mlx_lm" and len(prompts) > 1:
            why = stock_batch_quantize_reason()
            if why:
                raise NotImplementedError(why)
        quantize, factory = None, self.factories[mode]
        if kv_bits is not None and mode == "mlx_lm":         # stock's own path: generate_step converts its cache
            quantize = dict(self._quantize(kv_bits), quantized_kv_start=0)
        elif kv_bits is not None:
            factory = lambda model: self.factories[mode](model, **self._quantize(kv_bits))
        with as_shipped(mode, self.model):
            return run_mlx_lm(self.model, prompts, n, factory, self.prefill_step_size, quantize)

    def try_run(self, mode: str, prompts, n, kv_bits: int | None = None) -> Run | None:
        """run(), except that a variant that cannot run (a cache mlx-lm's loop refuses, a quantized
        cache it cannot make or MLX has no kernel for) is skipped with the reason instead of ending
        the benchmark; stock mlx-lm on the float cache and the engine modes must run."""
        try:
            return self.run(mode, prompts, n, kv_bits)
        except (ValueError, NotImplementedError, AttributeError, TypeError, RuntimeError) as e:
            if (mode in ENGINE_MODES or (mode == "mlx_lm" and kv_bits is None)
                    or (kv_bits is None and isinstance(e, RuntimeError))):
                raise
            with contextlib.suppress(RuntimeError):       # what the failed step left queued
                sync()
            what = "" if kv_bits is None else f" ({kv_bits}-bit, group {self.kv_group_size})"
            self.skipped[(mode, kv_bits)] = f"could not run{what} at batch {len(prompts)}: {type(e).__name__}: {e}"
            self.variants.remove((mode, kv_bits))
            return None


# ----------------------------------------------------------------------------- agreement check

def teacher_forced_logits(model, cache, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """float32 logits [len(tokens), V] of `model` on `cache` fed the prompt, then `tokens` one by one,
    each step evaluated as a decode loop does (one lazy graph of every step would make each cache
    write wait for the previous step's attention reads, a copy of the fused cache's buffer)."""
    out = [model(mx.array([prompt], dtype=mx.int32), cache=cache)[0, -1]]
    mx.eval(out[-1])
    for t in tokens[:-1]:
        out.append(model(mx.array([[t]], dtype=mx.int32), cache=cache)[0, -1])
        mx.eval(out[-1])
    return np.array(mx.stack(out).astype(mx.float32))


def check_agreement(size: Size, modes, dtypes, seed: int = 0) -> list[str]:
    """Before timing: the size's config cut to `check_layers` layers (every layer kind kept), batch
    of CHECK_BATCH prompts. float32: every mode's greedy tokens identical to mlx_lm's. Each half
    dtype asked for: the engine modes' recorded logits and the fused cache's teacher-forced logits
    within BF16_LOGIT_TOL x max |logit| of mlx-lm's own teacher-forced logits. Returns what was
    checked; BenchmarkError names the mode and request that disagree."""
    from mlx.utils import tree_map

    from registry.integrations.mlx_lm import make_own_cache

    cfg = dict(size.config, num_hidden_layers=min(size.check_layers, size.config["num_hidden_layers"]))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg["vocab_size"], CHECK_PROMPT).tolist() for _ in range(CHECK_BATCH)]
    done = []
    mx.random.seed(seed)
    model = random_model(cfg, mx.float32)
    runner = Modes(model, ["mlx_lm", *[m for m in modes if m != "mlx_lm"]], CHECK_BATCH * (CHECK_PROMPT + CHECK_TOKENS))
    want = runner.run("mlx_lm", prompts, CHECK_TOKENS).tokens
    ties: list[str] = []
    for m in list(runner.modes):
        if m == "mlx_lm":
            continue
        got = runner.try_run(m, prompts, CHECK_TOKENS)
        if got is None:
            continue
        for i, (g, w) in enumerate(zip(got.tokens, want)):
            if g == w:
                continue
            at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
            if at is not None:           # a near-tie of mlx-lm's own logits may flip on round-off alone
                ref = teacher_forced_logits(model, make_own_cache(model), prompts[i], w)[at]
                gap = float(ref[w[at]] - ref[g[at]])
                if gap <= NEAR_TIE * float(np.abs(ref).max()):
                    ties.append(f"{m} request {i} at token {at} (logit gap {gap:.2g})")
                    continue
            raise BenchmarkError(f"agreement check ({size.name}, float32, {cfg['num_hidden_layers']} layers): "
                                 f"mode {m} request {i} tokens {g} differ from mlx_lm's {w} (first at {at})")
    done.append(f"float32 tokens identical: {', '.join(runner.modes)} ({CHECK_BATCH} prompts of {CHECK_PROMPT}, "
                f"{CHECK_TOKENS} tokens, {cfg['num_hidden_layers']} layers)"
                + (f"; up to near-ties of mlx-lm's logits: {', '.join(ties)}" if ties else ""))
    del runner, model
    for dt in [d for d in dtypes if d != "float32"]:
        mx.random.seed(seed)
        model = random_model(cfg, getattr(mx, dt))
        runner = Modes(model, [m for m in modes if m != "mlx_lm"], CHECK_BATCH * (CHECK_PROMPT + CHECK_TOKENS),
                       record_logits=True)
        f32_model = random_model(cfg, mx.float32)       # the same half-precision weights, in float32
        f32_model.update(tree_map(lambda v: v.astype(mx.float32), model.parameters()))
        mx.eval(f32_model.parameters())
        worst, over = {}, []
        for m in runner.modes:
            if m in runner.engines:
                r = runner.run(m, prompts, CHECK_TOKENS)
                pairs = [(r.logits[i], r.tokens[i]) for i in range(len(prompts))]
            else:
                pairs = [(teacher_forced_logits(model, runner.factories[m](model), p, want_p), want_p)
                         for p, want_p in zip(prompts, want)]
            for i, (logits, toks) in enumerate(pairs):
                ref = teacher_forced_logits(model, make_own_cache(model), prompts[i], toks)
                err, scale = float(np.abs(logits - ref).max()), float(np.abs(ref).max())
                if not np.isfinite(err):
                    raise BenchmarkError(f"agreement check ({size.name}, {dt}): mode {m} request {i}: non-finite logits")
                if err > BF16_LOGIT_TOL * scale:
                    # docs/engine.md's second bound: against float32 (the same weights), the engine's error
                    # is at most twice mlx-lm's own half-precision error
                    truth = teacher_forced_logits(f32_model, make_own_cache(f32_model), prompts[i], toks)
                    eng, own = float(np.abs(logits - truth).max()), float(np.abs(ref - truth).max())
                    if eng > 2 * own + 1e-3 * scale:
                        raise BenchmarkError(
                            f"agreement check ({size.name}, {dt}): mode {m} request {i}: max |logit - mlx-lm| = "
                            f"{err:.4g} > {BF16_LOGIT_TOL} x max |logit| ({scale:.4g}), and its error against float32 "
                            f"({eng:.4g}) is more than twice mlx-lm's own ({own:.4g})")
                    over.append(f"{m} request {i}: {err / scale:.3f} of max|logit|, error vs float32 {eng:.3g} "
                                f"<= 2 x mlx-lm's {own:.3g}")
                worst[m] = max(worst.get(m, 0.0), err / scale)
        done.append(f"{dt} logits agree with mlx-lm's (max |diff| / max |logit|, bound {BF16_LOGIT_TOL}, else at "
                    f"most twice mlx-lm's own error against float32): "
                        + ", ".join(f"{m} {v:.4f}" for m, v in worst.items())
                    + (f"; past {BF16_LOGIT_TOL}: {'; '.join(over)}" if over else ""))
        del runner, model, f32_model
    gc.collect()
    mx.clear_cache()
    return done


# ----------------------------------------------------------------------------- timing

@dataclass
class E2ECell:
    size: str
    batch: int
    prompt: int
    dtype: str
    mode: str
    decode_tokens: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_ms_per_step: float
    rounds: int
    decode_s: list[float] = field(default_factory=list)      # per round
    prefill_s: list[float] = field(default_factory=list)
    implementation: str = ""
    floor_tokens_per_s: float = 0.0
    prompt_lengths: list[int] = field(default_factory=list)
    kv_bits: int | None = None                 # None: the float cache
    kv_group_size: int | None = None           # quantized cells only
    kv_peak_bytes: int | None = None           # the module docstring's KV memory: max over rounds
    kv_decode_peak_bytes: int | None = None
    kv_cache_bytes: int | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        if self.kv_bits is None:
            del d["kv_group_size"]
        return d


def prompt_lengths(batch: int, prompt: int) -> list[int]:
    """The nominal length for the even rows, three quarters of it for the odd ones (batch 1: nominal)."""
    return [prompt if b % 2 == 0 else max(1, prompt * 3 // 4) for b in range(batch)]


_BANDWIDTH: dict[str, float] = {}


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device copy (read + write), median of 5, measured once per process
    (the CPU: 256 MiB)."""
    key = str(mx.default_device())
    if key not in _BANDWIDTH:
        n = (2 << 30 if mx.default_device() != mx.cpu else 256 << 20) // 4
        x = mx.zeros((n,), dtype=mx.float32)
        mx.eval(x)
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            y = x + 1
            mx.eval(y)
            times.append(time.perf_counter() - t0)
            del y
        _BANDWIDTH[key] = 2 * 4 * n / statistics.median(times[1:])
        del x
        mx.clear_cache()
    return _BANDWIDTH[key]


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def step_bytes(model, config: dict, lengths: list[int], decode_tokens: int, kv_bits: int | None = None,
               kv_group_size: int = KV_GROUP_SIZE) -> int:
    """The bytes one decode step must read: the weights (every parameter, less the embedding table
    when the head is its own matrix: a step reads B rows of it) plus every layer's K/V rows at the
    middle of the decode (a sliding layer: at most its window). kv_bits: a full layer's rows are
    mlx-lm's quantized format (kv_bits / 8 bytes of packed words per feature, a scale and a bias in the
    model's dtype per kv_group_size features); sliding layers stay float, as mlx-lm and the drop-in
    cannot quantize a rotating cache."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    weights = sum(v.nbytes for v in params.values())
    if not config.get("tie_word_embeddings", True):
        weights -= sum(v.nbytes for k, v in params.items() if k.endswith("embed_tokens.weight"))
    item = next(iter(params.values())).dtype.size
    heads, D = config["num_key_value_heads"], head_dim(config)
    float_row = 2 * heads * D * item
    quant_row = float_row if kv_bits is None else 2 * heads * (D * kv_bits // 8 + 2 * (D // kv_group_size) * item)
    pattern, window = config.get("sliding_window_pattern"), config.get("sliding_window")
    total = 0
    for layer in range(config["num_hidden_layers"]):
        if pattern and window and (layer + 1) % pattern != 0:
            total += float_row * sum(min(n + decode_tokens // 2, window) for n in lengths)
        else:
            total += quant_row * sum(n + decode_tokens // 2 for n in lengths)
    return weights + total


def pool_needed(batch: int, prompt: int, decode_tokens: int) -> int:
    return batch * (prompt + decode_tokens - 1)


def time_cell(size: Size, model, dtype: str, batch: int, prompt: int, decode_tokens: int, modes, rounds: int,
              pool_size: int | None, seed: int = 0, prefill_step_size: int | None = None, kv_bits=(None,),
              kv_group_size: int = KV_GROUP_SIZE) -> tuple[list[E2ECell], dict[Variant, str]]:
    """Median of `rounds` interleaved rounds per variant (mode, kv_bits): every variant runs once in
    each round; (cells, {skipped variant: why})."""
    rng = np.random.default_rng(seed + 1000 * batch + prompt)
    lengths = prompt_lengths(batch, prompt)
    prompts = [rng.integers(0, size.config["vocab_size"], n).tolist() for n in lengths]
    bandwidth = copy_bandwidth()
    floors = {b: batch / (step_bytes(model, size.config, lengths, decode_tokens, b, kv_group_size) / bandwidth)
              for b in kv_bits}
    runner = Modes(model, modes, pool_size or pool_needed(batch, prompt, decode_tokens),
                   prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
                   head_dim=head_dim(size.config))
    warm = [p[:WARMUP_MAX_PROMPT] for p in prompts]
    for v in list(runner.variants):
        runner.try_run(v[0], warm, WARMUP_TOKENS, v[1])
    times: dict[Variant, list[tuple[float, float]]] = {v: [] for v in runner.variants}
    memory: dict[Variant, list[Run]] = {v: [] for v in runner.variants}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for v in list(runner.variants):
                sync()
                r = runner.try_run(v[0], prompts, decode_tokens, v[1])
                if r is None:                   # skipped from now on, its earlier rounds with it
                    del times[v], memory[v]
                    continue
                times[v].append((r.prefill_s, r.decode_s))
                memory[v].append(r)
    finally:
        if gc_was_enabled:
            gc.enable()
    cells = []
    for v in runner.variants:
        m, bits = v
        pre = statistics.median(t[0] for t in times[v])
        dec = statistics.median(t[1] for t in times[v])
        n = decode_tokens - 1
        most = lambda key: max((getattr(r, key) for r in memory[v] if getattr(r, key) is not None), default=None)
        cells.append(E2ECell(size.name, batch, prompt, dtype, m, decode_tokens,
                             decode_tokens_per_s=batch * n / dec if dec > 0 else 0.0,
                             prefill_tokens_per_s=sum(lengths) / pre if pre > 0 else 0.0,
                             decode_ms_per_step=dec / n * 1e3 if n else 0.0, rounds=rounds,
                             decode_s=[round(t[1], 6) for t in times[v]],
                             prefill_s=[round(t[0], 6) for t in times[v]],
                             implementation=runner.implementation.get(m, "mlx-lm"),
                             floor_tokens_per_s=floors[bits], prompt_lengths=lengths,
                             kv_bits=bits, kv_group_size=None if bits is None else kv_group_size,
                             kv_peak_bytes=most("kv_peak_bytes"), kv_decode_peak_bytes=most("kv_decode_peak_bytes"),
                             kv_cache_bytes=most("kv_cache_bytes")))
    skipped = dict(runner.skipped)
    del runner
    gc.collect()
    mx.clear_cache()
    return cells, skipped


def skipped_entry(size: str, dtype: str, batch: int, prompt: int, variant: Variant, kv_group_size: int,
                  reason: str) -> dict:
    """A skipped variant as the JSON's `skipped` list holds it."""
    mode, bits = variant
    return dict(size=size, dtype=dtype, batch=batch, prompt=prompt, mode=mode, kv_bits=bits,
                **({} if bits is None else dict(kv_group_size=kv_group_size)), reason=reason)


def run(sizes, dtypes, batches, prompts, decode_tokens: int, modes, rounds: int, pool_size: int | None = None,
        check: bool = True, progress: Callable | None = None, log: Callable[[str], None] = lambda s: None,
        prefill_step_size: int | None = None, kv_bits=(None,), kv_group_size: int = KV_GROUP_SIZE
        ) -> tuple[list[E2ECell], list[dict], list[str]]:
    """Every (size, dtype, batch, prompt) cell, each mode on the float cache (kv_bits None) and on each
    kv_bits: (cells, skipped [{size, ..., mode, kv_bits, reason}], checks done). The agreement check
    covers the float cache's modes."""
    cells, skipped, checks = [], [], []
    grid = [(s, d, b, p) for s in sizes for d in dtypes for b in batches for p in prompts]
    float_modes = modes if None in kv_bits else []
    i = 0
    for s in sizes if check and float_modes else ():   # every check before any timing: a failure costs seconds
        for line in check_agreement(SIZES[s], float_modes, dtypes):
            checks.append(f"{s}: {line}")
            log(f"# check {s}: {line}")
    for s in sizes:
        size = SIZES[s]
        for d in dtypes:
            mx.random.seed(0)
            t0 = time.perf_counter()
            model = random_model(size.config, getattr(mx, d))
            log(f"# {s} {d}: random weights in {time.perf_counter() - t0:.1f}s")
            for b in batches:
                for p in prompts:
                    i += 1
                    got, why = time_cell(size, model, d, b, p, decode_tokens, modes, rounds, pool_size,
                                         prefill_step_size=prefill_step_size, kv_bits=kv_bits,
                                         kv_group_size=kv_group_size)
                    cells += got
                    skipped += [skipped_entry(s, d, b, p, v, kv_group_size, r) for v, r in why.items()]
                    if progress:
                        progress(i, len(grid), got, why)
            del model
            gc.collect()
            mx.clear_cache()
    return cells, skipped, checks
