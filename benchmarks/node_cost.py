"""What one graph node costs the host, by kind: N independent nodes of one kind (distinct inputs and
pools per node, like the layers of one step) are built, then evaluated; build and eval (to the
stream's end) are timed apart, per node, median of --steps, the kinds in interleaved rounds
(runner.time_steps). Kinds: the fused qk_norm call (`aot_qk_norm`), the fused rope call
(`aot_rope`), the fused K/V store (`aot_kv_store`), and MLX's own `rms_norm`, `rope`, `scatter` (a
pool row store, as mlx_lm's slot caches write) and `add`. With the number of inputs and outputs of
each kind beside it, this tells the launcher's per-node cost from MLX's own. On a GPU host the eval
column also holds the CUDA graph's build, update and launch, and the GPU's time (tiny at decode
sizes). docs/benchmarks/e2e-root-cause.md, "A decode step is bound by the host, per graph node".

    python -m benchmarks.node_cost [--nodes 32] [--tokens 8] [--steps 40] [--kinds aot_qk_norm,rms_norm]
"""
from __future__ import annotations

import argparse
import functools

import mlx.core as mx
import numpy as np

from .cases import SHAPES, int_in, layer_count
from .runner import time_steps

KINDS = ("aot_qk_norm", "aot_rope", "aot_kv_store", "rms_norm", "rope", "scatter", "add")
AOT_KERNELS = dict(aot_qk_norm="qk_norm_rope_pool_fused", aot_rope="rope_pool_fused", aot_kv_store="kv_pool_store")
# (inputs, outputs) of MLX's own nodes; the AOT kinds' come from their kernels.yaml signatures (edges())
MLX_EDGES = dict(rms_norm=(2, 1), rope=(2, 1), scatter=(3, 1), add=(2, 1))


@functools.lru_cache(maxsize=None)
def _specs() -> dict:
    """The manifest's spec of every AOT kind, the manifest read once (edges and _builders)."""
    from registry.manifest import load_manifest

    manifest = load_manifest()
    return {kind: manifest.kernel(name) for kind, name in AOT_KERNELS.items()}


def edges(kind: str) -> tuple[int, int]:
    """(inputs, outputs) of a kind's node: MLX's host cost per node grows with them."""
    if kind in MLX_EDGES:
        return MLX_EDGES[kind]
    sig = _specs()[kind].signature
    return len(sig.inputs), len(sig.outputs)


def _kind_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",")]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(KINDS)}")
    return kinds


def _builders(n: int, T: int):
    from registry.core import backend_of
    from registry.kernels.kv_pool_store import KvPoolStoreKernel
    from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
    from registry.kernels.rope_pool_fused import RopePoolFusedKernel
    from registry.native import device_indices

    from .cases import rope_for
    from .micro import NORM

    shape = SHAPES["llama-8b"]
    H, Hkv, D, S = shape.n_q_heads, shape.n_kv_heads, shape.head_dim, 4 * T + 64
    rope = rope_for(shape, "base")
    backend = backend_of(None)
    spec = _specs()
    qk = QkNormRopePoolFusedKernel.build(spec["aot_qk_norm"],
                                         QkNormRopePoolFusedKernel.context_for((rope, NORM), backend))
    rp = RopePoolFusedKernel.build(spec["aot_rope"], RopePoolFusedKernel.context_for(rope, backend))
    kv = KvPoolStoreKernel.build(spec["aot_kv_store"], KvPoolStoreKernel.context_for(None, backend))
    positions, slots = device_indices(backend, 3000 + np.arange(T), np.arange(T) * 3)
    mk = lambda *s: mx.random.normal(s).astype(mx.bfloat16)
    L = [dict(q=mk(T, H, D), k=mk(T, Hkv, D), v=mk(T, Hkv, D), w=1 + 0.1 * mk(D),
              kp=mx.zeros((S, Hkv, D), mx.bfloat16), vp=mx.zeros((S, Hkv, D), mx.bfloat16)) for _ in range(n)]
    mx.eval(positions, slots, *[a for d in L for a in d.values()])
    qk_launch, rp_launch, kv_launch = qk.last_bound(), rp.last_bound(), kv.last_bound()

    def aot_qk_norm():
        out = []
        for d in L:
            q, k, d["kp"], d["vp"] = qk_launch(d["q"], d["k"], d["v"], positions, slots, d["kp"], d["vp"], d["w"], d["w"])
            out += [q, k, d["kp"], d["vp"]]
        return out

    def aot_rope():
        out = []
        for d in L:
            q, k, d["kp"], d["vp"] = rp_launch(d["q"], d["k"], d["v"], positions, slots, d["kp"], d["vp"])
            out += [q, k, d["kp"], d["vp"]]
        return out

    def aot_kv_store():
        out = []
        for d in L:
            d["kp"], d["vp"] = kv_launch(d["k"], d["v"], slots, d["kp"], d["vp"])
            out += [d["kp"], d["vp"]]
        return out

    def rms_norm():
        return [mx.fast.rms_norm(d["q"], d["w"], 1e-6) for d in L]

    def rope_():
        return [mx.fast.rope(d["q"][:, :, None], D, traditional=False, base=rope.base, scale=1.0,
                             offset=positions) for d in L]

    def scatter():
        out = []
        for d in L:
            d["kp"][slots] = d["k"]       # `d` holds the pool's only handle: MLX scatters in place
            out.append(d["kp"])
        return out

    def add():
        return [d["q"] + d["q"] for d in L]

    impl = dict(aot_qk_norm=qk.implementation, aot_rope=rp.implementation, aot_kv_store=kv.implementation)
    return dict(aot_qk_norm=aot_qk_norm, aot_rope=aot_rope, aot_kv_store=aot_kv_store, rms_norm=rms_norm, rope=rope_, scatter=scatter,
                add=add), impl


def run(kinds, n: int, T: int, steps: int) -> list[tuple[str, float, float]]:
    """(name, build us, eval us) per node for each kind; the kinds interleave in rounds
    (runner.time_steps), and build is the median step less the median eval."""
    builders, impl = _builders(n, T)
    times = time_steps({k: builders[k] for k in kinds}, steps, warmup=3)
    return [(f"{k} ({impl[k]})" if k in impl else k, (times[k][0] - times[k][1]) / n * 1e6, times[k][1] / n * 1e6)
            for k in kinds]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.node_cost")
    p.add_argument("--nodes", type=layer_count, default=32, help="independent nodes per step, 1-256 (default 32)")
    p.add_argument("--tokens", type=int_in(1, 4096), default=8, help="tokens per node, 1-4096 (default 8)")
    p.add_argument("--steps", type=layer_count, default=40, help="timed steps per kind, 1-256 (default 40)")
    p.add_argument("--kinds", type=_kind_list, default=list(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    a = p.parse_args(argv)
    print(f"# {mx.default_device()}, mlx {mx.__version__}; {a.nodes} independent nodes per step, T={a.tokens}, "
          f"llama-8b heads; us per node, median of {a.steps} steps")
    print(f"{'kind':<32} {'in/out':>7} {'build us':>9} {'eval us':>9} {'total':>9}")
    for kind, (name, b, e) in zip(a.kinds, run(a.kinds, a.nodes, a.tokens, a.steps)):
        print(f"{name:<32} {'%d/%d' % edges(kind):>7} {b:9.2f} {e:9.2f} {b + e:9.2f}")


if __name__ == "__main__":
    main()
