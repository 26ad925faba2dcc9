"""Probe (not a test): where one batch-1 decode step of mlx-lm's own loop goes, with mlx-lm's caches
and with the drop-in fused cache (registry.integrations.mlx_lm.make_prompt_cache), on the current
device: building the step's graph in Python, queueing it (mx.async_eval: MLX's encode), and the
whole pipelined step, the first two also in this thread's CPU time (what another process on a
shared host cannot inflate, bar clock changes); plus the launcher's counters (copies and syncs must
stay 0). Sizes from benchmarks/e2e.SIZES (random bf16 weights). docs/benchmarks/e2e-root-cause.md.

    PYTHONPATH=. python3 tests/gpu/diag_step.py [--sizes llama-1b,llama-8b] [--steps 64] [--profile N]

--profile N: afterwards, cProfile N steps' graph building with each cache and print the N functions
with the most own time.
--build-only: time only the graph building of each step in this thread's CPU time (immune to the
other processes of a shared host; the step is evaluated before the next one is built), on any
device, e.g. this CPU box: `--sizes tiny-llama --layers 16 --prompt 32 --build-only --profile 30`.
Where mx.fast.rope builds its fallback graph in Python (the CPU), stock mlx-lm's figure includes
it, so compare the fused cache's us/layer before and after a change rather than the two modes.
--caches: mlx_lm (stock), fused_cache (the drop-in cache: direct forward where the layer allows it),
fused_capture (every fused layer through the rope capture).
--direct N: afterwards, time N runs of every layer's cache step in the direct forward's form with
each cache (stock: q/k norms where the layer has them, two rope calls and update_and_fetch; the
drop-in cache: its direct_update, one kernel call) followed by the attention's sdpa, on each
layer's own q/k/v shapes (one decode token, q/k/v evaluated beforehand): building those graph nodes
and queueing them (mx.async_eval: MLX's encode) in this thread's CPU time, per layer (min and
median), and their node count per layer. The one part of a direct-forward layer that differs
between the two caches, on the device's own ops (mx.fast.rope is a fallback graph on the CPU).
--prefill N: afterwards, time N prefills of --prompt tokens per cache on mlx-lm's generation stream.
--section N: afterwards, time N x 50 runs of one layer's cache section as model code runs it (two
`cache.offset` reads, two rope calls, update_and_fetch) with each cache, on layer 0's own q/k/v
shapes, in this thread's CPU time (min and median per run): the part of a layer the two modes do
differently (the rope is mx.fast.rope's fallback graph on the CPU, as above).
"""
import argparse
import cProfile
import pstats
import time

import mlx.core as mx

from benchmarks.e2e import SIZES, as_shipped, random_model
from registry import native
from registry.integrations.mlx_lm import make_own_cache, make_prompt_cache

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="llama-1b,llama-8b")
p.add_argument("--steps", type=int, default=64)
p.add_argument("--profile", type=int, default=0)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--layers", type=int, default=0, help="override the size's layer count")
p.add_argument("--build-only", action="store_true")
p.add_argument("--section", type=int, default=0)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--direct", type=int, default=0)
p.add_argument("--prefill", type=int, default=0, help="afterwards, time N prefills of --prompt tokens with each "
               "cache (a fresh one each), on mlx-lm's generation stream as generate_step runs them")
p.add_argument("--caches", default="mlx_lm,fused_cache", help="which caches to run (e.g. one, under a profiler): "
               "mlx_lm, fused_cache (direct attention where the layer allows it), fused_capture")
args = p.parse_args()
for flag, value, least in (("--steps", args.steps, 1), ("--prompt", args.prompt, 1), ("--rounds", args.rounds, 1),
                          ("--layers", args.layers, 0), ("--profile", args.profile, 0), ("--section", args.section, 0),
                          ("--prefill", args.prefill, 0), ("--direct", args.direct, 0)):
    if value < least:
        p.error(f"{flag}: {value} is below {least}")
unknown_sizes = [s for s in args.sizes.split(",") if s not in SIZES]
if unknown_sizes:
    p.error(f"--sizes: unknown {', '.join(unknown_sizes)} (choose from {', '.join(SIZES)})")


def median(xs):
    return sorted(xs)[len(xs) // 2]


def prefilled(model, make):
    cache = make(model)
    y = mx.argmax(model(mx.array([[1] * args.prompt]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    return cache, y


def measure_build(name, rnd, label, model, make):
    cache, y = prefilled(model, make)
    build = []
    for _ in range(args.steps):
        t0 = time.thread_time()
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        build.append(time.thread_time() - t0)
        mx.eval(nxt)
        y = nxt
    layers = len(model.layers)
    print(f"{name} round {rnd} {label:12s} build {1e3 * median(build):6.3f} ms "
          f"({1e6 * median(build) / layers:5.1f} us/layer)  min {1e6 * min(build) / layers:5.1f} us/layer", flush=True)


# The section as attention code runs it: only model code gets the offsets the fused cache captures.
_SECTION = {"__name__": "mlx_lm.models.diag_step_section"}
exec("""
def section(rope, cache, q, k, v):
    q = rope(q, offset=cache.offset)
    k = rope(k, offset=cache.offset)
    return q, cache.update_and_fetch(k, v)
""", _SECTION)


def measure_section(name, rnd, label, model, make):
    attn, cache = model.model.layers[0].self_attn, make(model)[0]
    D = getattr(model.args, "head_dim", None) or model.args.hidden_size // attn.n_heads
    q, k, v = (mx.random.normal((1, h, 1, D)).astype(mx.bfloat16) for h in (attn.n_heads, attn.n_kv_heads,
                                                                           attn.n_kv_heads))
    mx.eval(q, k, v)
    per_call = []
    for _ in range(args.section):
        t0 = time.thread_time()
        for _ in range(50):
            _SECTION["section"](attn.rope, cache, q, k, v)   # results dropped: no reader holds the buffer
        per_call.append((time.thread_time() - t0) / 50)
        mx.eval(cache.keys, cache.values)
    print(f"{name} round {rnd} {label:12s} cache section min {1e6 * min(per_call):6.2f} us  "
          f"median {1e6 * median(per_call):6.2f} us", flush=True)


def measure_direct(name, rnd, label, model, make):
    from benchmarks.graph_count import count
    from registry.integrations import direct_attention
    from registry.integrations.mlx_lm import attention_of, model_layers

    caches, _ = prefilled(model, make)
    attns = [attention_of(layer) for layer in model_layers(model)]
    layers = []
    for attn, cache in zip(attns, caches):
        hidden = attn.o_proj.weight.shape[0]
        x = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
        q, k, v = (proj(x).reshape(1, 1, h, -1).transpose(0, 2, 1, 3)
                   for proj, h in ((attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads),
                                   (attn.v_proj, attn.n_kv_heads)))
        mx.eval(q, k, v)
        norms = bool(getattr(attn, "q_norm", None) is not None)
        step = type(cache).direct_update if hasattr(type(cache), "direct_update") else None
        layers.append((attn, cache, q, k, v, norms, step, direct_attention._sdpa_of(direct_attention.base_class(attn))))

    def section():
        outs = []
        for attn, cache, q, k, v, norms, step, sdpa in layers:
            if step is None:
                q2, keys, values = direct_attention.stock_step(cache, attn, q, k, v, norms)
            else:
                q2, keys, values = step(cache, attn, q, k, v, norms)
            outs.append(sdpa(q2, keys, values, cache=cache, scale=attn.scale, mask=None))
        return outs

    nodes = sum(count(section()).values()) / len(layers)
    mx.synchronize()
    build, queue = [], []
    for _ in range(args.direct):
        c0 = time.thread_time()
        outs = section()
        c1 = time.thread_time()
        mx.async_eval(outs)
        c2 = time.thread_time()
        mx.synchronize()
        build.append((c1 - c0) / len(layers)), queue.append((c2 - c1) / len(layers))
    print(f"{name} round {rnd} {label:12s} direct section ({nodes:.1f} nodes/layer) thread CPU per layer: build min "
          f"{1e6 * min(build):6.2f} median {1e6 * median(build):6.2f} us  queue min {1e6 * min(queue):6.2f} median "
          f"{1e6 * median(queue):6.2f} us", flush=True)


def measure(name, rnd, label, model, make):
    cache, y = prefilled(model, make)
    native.reset_stats()
    build, queue, step, cpu_build, cpu_queue = [], [], [], [], []
    for _ in range(args.steps):          # generate_step's pattern: queue n+1, then read n
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = model(y[:, None], cache=cache)[:, -1]
        nxt = mx.argmax(logits, axis=-1)
        t1, c1 = time.perf_counter(), time.thread_time()
        mx.async_eval(nxt)
        t2, c2 = time.perf_counter(), time.thread_time()
        y.item()
        t3 = time.perf_counter()
        build.append(t1 - t0), queue.append(t2 - t1), step.append(t3 - t0)
        cpu_build.append(c1 - c0), cpu_queue.append(c2 - c1)
        y = nxt
    y.item()
    st = native.stats()
    layers = len(model.layers)
    print(f"{name} round {rnd} {label:12s} step {1e3 * median(step):6.3f} ms ({1 / median(step):6.1f} tok/s)  "
          f"build {1e3 * median(build):6.3f} ms ({1e6 * median(build) / layers:5.1f} us/layer)  "
          f"queue {1e3 * median(queue):6.3f} ms  thread CPU: build {1e3 * median(cpu_build):6.3f} ms  queue "
          f"{1e3 * median(cpu_queue):6.3f} ms  copies {st['copies']} syncs {st['syncs']}", flush=True)


def measure_prefill(name, rnd, label, model, make):
    from mlx_lm.generate import generation_stream

    prompt = mx.array([[1] * args.prompt])
    build, total = [], []
    for _ in range(args.prefill):
        cache = make(model)
        mx.synchronize()
        with mx.stream(generation_stream):
            t0 = time.perf_counter()
            logits = model(prompt, cache=cache)[:, -1]
            t1 = time.perf_counter()
            mx.eval(logits, [c.state for c in cache])
            t2 = time.perf_counter()
        build.append(t1 - t0), total.append(t2 - t0)
    print(f"{name} round {rnd} {label:12s} prefill {args.prompt} tokens {1e3 * median(total):7.3f} ms  "
          f"build {1e3 * median(build):6.3f} ms", flush=True)


def profile(name, label, model, make):
    cache, y = prefilled(model, make)
    prof = cProfile.Profile()
    for _ in range(args.profile):
        prof.enable()
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        prof.disable()
        mx.eval(nxt)
        y = nxt
    print(f"{name} {label}: graph building of {args.profile} steps, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


_MAKERS = {"mlx_lm": make_own_cache, "fused_cache": make_prompt_cache,
           "fused_capture": lambda model: make_prompt_cache(model, direct=False)}   # every layer through the capture
unknown = set(args.caches.split(",")) - set(_MAKERS)
if unknown:
    p.error(f"--caches: unknown {', '.join(sorted(unknown))} (choose from {', '.join(_MAKERS)})")
CACHES = tuple((c, _MAKERS[c]) for c in args.caches.split(","))
for name in args.sizes.split(","):
    config = dict(SIZES[name].config, **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = random_model(config, mx.bfloat16)
    for rnd in range(args.rounds):
        for label, make in CACHES:
            with as_shipped(label, model):
                (measure_build if args.build_only else measure)(name, rnd, label, model, make)
    for label, make in CACHES if args.profile else ():
        with as_shipped(label, model):
            profile(name, label, model, make)
    for rnd in range(args.rounds) if args.prefill else ():
        for label, make in CACHES:
            with as_shipped(label, model):
                measure_prefill(name, rnd, label, model, make)
    for rnd in range(args.rounds) if args.direct else ():
        for label, make in CACHES:
            with as_shipped(label, model):
                measure_direct(name, rnd, label, model, make)
    for rnd in range(args.rounds) if args.section else ():
        for label, make in CACHES:
            with as_shipped(label, model):
                measure_section(name, rnd, label, model, make)
