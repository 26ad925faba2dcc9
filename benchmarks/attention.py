"""Decode-attention micro benchmark: decode_attention against MLX's own attention call, masked and
unmasked, and the K/V read floor measured in the same run.

Per cell (batch B, context S): `layers` layers' worth of calls in one graph (each layer its own
head-major K/V buffers [B, Hkv, S + 256, D], the rows of half the batch left-padded to 3/4 of S, as
mlx-lm's BatchKVCache holds a server's prompts), evaluated once per step, median of `steps` steps:
  - `kernel`: decode_attention reading the buffers in place, each row's valid range as data;
  - `mlx_masked`: mx.fast.scaled_dot_product_attention on the [B, Hkv, S, D] views with mlx-lm's
    boolean mask (what BatchKVCache gives the attention);
  - `mlx_unmasked`: the same call with no mask (a lone KVCache's: it attends to the padding too, so
    it is a speed reference, not an equal result);
  - `copy`: a copy of the layers' K/V buffers (read + write), reported as copy_tb_per_s.
floor_us = the K/V bytes the valid rows need, read once, at the device's copy bandwidth measured in
the same run on one 2 GiB buffer (benchmarks.e2e.copy_bandwidth: a small buffer's copy is bound by
its launch, not by memory). `python -m build_tools bench --kernel decode_attention` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np

from registry.core import backend_of
from registry.kernels.decode_attention import DecodeAttentionKernel
from registry.manifest import load_manifest

from .runner import time_steps

CELLS = ((1, 16384), (4, 16384), (8, 16384), (32, 16384), (1, 32768), (4, 32768), (32, 2048))
CPU_CELLS = ((1, 1024), (4, 1024), (4, 4096))      # a 2-core CPU: seconds, not minutes
TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class AttentionCell:
    batch: int
    context: int
    dtype: str
    implementation: str
    us_per_layer: dict[str, float] = field(default_factory=dict)
    floor_us_per_layer: float = 0.0
    copy_tb_per_s: float = 0.0
    max_err: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["fraction_of_floor"] = {k: self.floor_us_per_layer / v for k, v in self.us_per_layer.items() if v}
        return d


def lengths(B: int, S: int) -> list[int]:
    """The nominal length for half the rows, three quarters of it for the other half."""
    return [S if b % 2 == 0 else S * 3 // 4 for b in range(B)]


def run_cell(kernel, B: int, S: int, *, n_q: int, n_kv: int, D: int, dtype, layers: int, steps: int,
             warmup: int) -> AttentionCell:
    rows = S + 256                               # mlx-lm grows its buffers by 256 rows
    lens = lengths(B, S)
    end = S                                      # one past the newest row (BatchKVCache: _idx)
    rng = np.random.default_rng(0)
    keys = [mx.random.normal((B, n_kv, rows, D), key=mx.random.key(2 * i)).astype(dtype) for i in range(layers)]
    vals = [mx.random.normal((B, n_kv, rows, D), key=mx.random.key(2 * i + 1)).astype(dtype) for i in range(layers)]
    qs = [mx.array(rng.standard_normal((B, n_q, 1, D)).astype(np.float32)).astype(dtype) for _ in range(layers)]
    kv_len = mx.array(lens, dtype=mx.int32)
    kv_end = mx.full((B,), end, dtype=mx.int32)
    left = mx.array([end - n for n in lens], dtype=mx.int32)
    mask = (mx.arange(end)[None] >= left[:, None])[:, None, None, :]       # [B, 1, 1, S]
    scale = D ** -0.5
    mx.eval(keys, vals, qs, kv_len, kv_end, mask)

    def ours():
        return [kernel(q, k, v, kv_len, kv_end, scale=scale, check=False) for q, k, v in zip(qs, keys, vals)]

    def masked():
        return [mx.fast.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], scale=scale, mask=mask)
                for q, k, v in zip(qs, keys, vals)]

    def unmasked():
        return [mx.fast.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], scale=scale)
                for q, k, v in zip(qs, keys, vals)]

    def copy():                                  # whole buffers: a row-contiguous elementwise copy
        return [k + 0 for k in keys] + [v + 0 for v in vals]

    got = mx.concatenate([o.astype(mx.float32).reshape(-1) for o in ours()[:2]])
    want = mx.concatenate([o.astype(mx.float32).reshape(-1) for o in masked()[:2]])
    err = float(mx.max(mx.abs(got - want)).item())
    times = time_steps(dict(kernel=ours, mlx_masked=masked, mlx_unmasked=unmasked, copy=copy), steps, warmup)
    us = {k: t[0] / layers * 1e6 for k, t in times.items()}
    from .e2e import copy_bandwidth

    copy_bytes = 2 * 2 * B * n_kv * rows * D * mx.zeros((), dtype).itemsize   # K and V, read + write
    need = 2 * sum(lens) * n_kv * D * mx.zeros((), dtype).itemsize               # the valid rows, read once
    cell = AttentionCell(B, S, str(dtype).replace("mlx.core.", ""), kernel.implementation,
                         {k: v for k, v in us.items() if k != "copy"}, need / copy_bandwidth() * 1e6,
                         copy_bytes / (us["copy"] * 1e-6) / 1e12, err)
    del keys, vals
    return cell


def run(cells=CELLS, dtype=mx.bfloat16, *, n_q=32, n_kv=8, D=128, layers=8, steps=20, warmup=3, progress=None):
    spec = load_manifest().kernel("decode_attention")
    kernel = DecodeAttentionKernel.build(spec, DecodeAttentionKernel.context_for(None, backend_of()))
    out = []
    for B, S in cells:
        cell = run_cell(kernel, B, S, n_q=n_q, n_kv=n_kv, D=D, dtype=dtype, layers=layers, steps=steps, warmup=warmup)
        tol = TOL[cell.dtype]
        if cell.max_err > tol:
            raise SystemExit(f"decode_attention disagrees with MLX's masked attention at B={B} S={S}: max error "
                             f"{cell.max_err:.3g} > {tol}")
        out.append(cell)
        if progress:
            progress(cell)
        mx.clear_cache()
    return out


def row(c: AttentionCell) -> str:
    f = c.to_json()["fraction_of_floor"]
    return (f"B={c.batch:<3} S={c.context:<6} {c.dtype:<9} floor {c.floor_us_per_layer:8.1f} us  "
            + "  ".join(f"{k} {v:8.1f} us ({100 * f[k]:5.1f}%)" for k, v in c.us_per_layer.items())
            + f"  copy {c.copy_tb_per_s:.2f} TB/s  err {c.max_err:.2g}  [{c.implementation}]")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--cells", help="comma list of BxS (default: " + ",".join(f"{b}x{s}" for b, s in CELLS)
                   + "; on the CPU " + ",".join(f"{b}x{s}" for b, s in CPU_CELLS) + ")")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--commit", help="commit to record when the tree has no .git")
    a = p.parse_args(argv)
    if a.cells is None:
        a.cells = ",".join(f"{b}x{s}" for b, s in (CPU_CELLS if mx.default_device() == mx.cpu else CELLS))
    try:
        cells = [tuple(int(x) for x in c.split("x")) for c in a.cells.split(",")]
        assert all(len(c) == 2 and c[0] >= 1 and c[1] >= 1 for c in cells)
    except (ValueError, AssertionError):
        p.error(f"--cells: expected a comma list of BxS with positive integers (e.g. 4x16384), got {a.cells!r}")
    if a.layers < 1 or a.steps < 1:
        p.error("--layers and --steps must be >= 1")
    t0 = time.time()
    res = run(cells, getattr(mx, a.dtype), layers=a.layers, steps=a.steps, progress=lambda c: print(row(c), flush=True))
    from registry.native import stats
    print("launcher:", {k: v for k, v in stats().items() if k in ("launches", "copies", "syncs")})
    if a.json_path:
        import datetime
        import platform
        import subprocess

        from .e2e import copy_bandwidth

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(a.json_path, "w") as f:
            json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           host=platform.node(), device=str(mx.default_device()), mlx=mx.__version__,
                           commit=a.commit or commit or "?", command="python -m benchmarks.attention "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                           copy_tb_per_s=copy_bandwidth() / 1e12, cells=[c.to_json() for c in res],
                           seconds=time.time() - t0), f, indent=1)


if __name__ == "__main__":
    main()
