"""Decode-attention micro benchmark: decode_attention against MLX's own attention call, masked and
unmasked, and the K/V read floor measured in the same run; with --quantized, decode_attention_quantized
on the same buffers quantized to 8 and 4 bits against decode_attention on the float ones.

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

With --quantized (`bench --kernel decode_attention_quantized`) the same buffers, also quantized with
mx.quantize at 8 and 4 bits (--group-size, default 64; mlx-lm's QuantizedKVCache format: words,
scales and biases), and the cases
  - `kernel_q8`, `kernel_q4`: decode_attention_quantized reading the packed buffers in place;
  - `kernel_bf16` (`kernel_f16`, `kernel_f32` for those dtypes): decode_attention on the float buffers,
    the baseline of issue 35's targets (the drop-in's 8-bit >= 1.2x, 4-bit >= 1.4x its tokens/s);
  - `mlx_dequantized_q8`, `mlx_dequantized_q4`: mx.dequantize of the valid views, then MLX's attention
    with mlx-lm's boolean mask (what the quantized drop-in cache falls back to for prefill);
  - `copy`, as above.
Each format has its own floor (the valid rows' words, scales and biases, or float rows, read once);
each case's share is of its format's floor, `speedup` is kernel_bf16's time over kernel_q8's and
kernel_q4's, and `max_err` is each kernel's against its pure-MLX reference (decode_attention_reference,
decode_attention_quantized_reference).
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
from registry.kernels._base import PoolFormat
from registry.kernels.decode_attention import DecodeAttentionKernel, decode_attention_reference
from registry.kernels.decode_attention_quantized import DecodeAttentionQuantizedKernel
from registry.manifest import load_manifest

from .runner import time_steps

CELLS = ((1, 16384), (4, 16384), (8, 16384), (32, 16384), (1, 32768), (4, 32768), (32, 2048))
CPU_CELLS = ((1, 1024), (4, 1024), (4, 4096))      # a 2-core CPU: seconds, not minutes
TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}
# decode_attention_quantized against its reference: docs/kernel-abi.md's tolerance (CUDA's tensor-core
# path rounds the dequantized rows to the dtype before its mma, as mx.dequantize does)
QUANT_TOL = {"float32": 1e-4, "float16": 8e-3, "bfloat16": 6e-2}
BITS = (8, 4)
SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def dtype_name(dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


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

    def floor_of(self, case: str) -> float:
        return self.floor_us_per_layer

    def to_json(self) -> dict:
        d = asdict(self)
        d["fraction_of_floor"] = {k: self.floor_of(k) / v for k, v in self.us_per_layer.items() if v}
        return d


@dataclass
class QuantizedAttentionCell(AttentionCell):
    """--quantized: a floor per format (`bf16`, `q8`, `q4`: a case's name ends with its format) and
    an error per kernel case."""
    floor_us_per_layer: dict[str, float] = field(default_factory=dict)
    max_err: dict[str, float] = field(default_factory=dict)
    group_size: int = 64

    def floor_of(self, case: str) -> float:
        return self.floor_us_per_layer[case.rsplit("_", 1)[-1]]

    def to_json(self) -> dict:
        d = super().to_json()
        base = "kernel_" + SHORT[self.dtype]
        us, floor = self.us_per_layer, self.floor_us_per_layer
        d["speedup"] = {f"q{b}": us[base] / us[f"kernel_q{b}"] for b in BITS if us.get(f"kernel_q{b}")}
        d["floor_speedup"] = {f"q{b}": floor[SHORT[self.dtype]] / floor[f"q{b}"] for b in BITS if f"q{b}" in floor}
        return d


def lengths(B: int, S: int) -> list[int]:
    """The nominal length for half the rows, three quarters of it for the other half."""
    return [S if b % 2 == 0 else S * 3 // 4 for b in range(B)]


@dataclass
class Buffers:
    """A cell's inputs: per layer a query and head-major K/V buffers, the rows' ranges and mlx-lm's mask."""
    lens: list[int]
    end: int                                     # one past the newest row (BatchKVCache: _idx)
    keys: list
    vals: list
    qs: list
    kv_len: mx.array
    kv_end: mx.array
    mask: mx.array                               # [B, 1, 1, end], True where a key is valid


def buffers(B: int, S: int, *, n_q: int, n_kv: int, D: int, dtype, layers: int) -> Buffers:
    rows = S + 256                               # mlx-lm grows its buffers by 256 rows
    lens = lengths(B, S)
    end = S
    rng = np.random.default_rng(0)
    keys = [mx.random.normal((B, n_kv, rows, D), key=mx.random.key(2 * i)).astype(dtype) for i in range(layers)]
    vals = [mx.random.normal((B, n_kv, rows, D), key=mx.random.key(2 * i + 1)).astype(dtype) for i in range(layers)]
    qs = [mx.array(rng.standard_normal((B, n_q, 1, D)).astype(np.float32)).astype(dtype) for _ in range(layers)]
    left = mx.array([end - n for n in lens], dtype=mx.int32)
    buf = Buffers(lens, end, keys, vals, qs, mx.array(lens, dtype=mx.int32), mx.full((B,), end, dtype=mx.int32),
                  (mx.arange(end)[None] >= left[:, None])[:, None, None, :])
    mx.eval(buf.keys, buf.vals, buf.qs, buf.kv_len, buf.kv_end, buf.mask)
    return buf


def row_bytes(x) -> int:
    """Bytes of one K (or V) row of one head: a float row, or a quantized group's words, scales and biases."""
    return sum(a.shape[-1] * a.itemsize for a in (x if isinstance(x, tuple) else (x,)))


def timed(builders: dict, layers: int, steps: int, warmup: int, copy_bytes: int) -> tuple[dict[str, float], float]:
    """(us per layer per case, copy TB/s of the `copy` case)."""
    times = time_steps(builders, steps, warmup)
    us = {k: t[0] / layers * 1e6 for k, t in times.items()}
    copy_us = us.pop("copy")
    return us, copy_bytes / (copy_us * 1e-6) / 1e12


def max_err(outs, wants) -> float:
    got = mx.concatenate([o.astype(mx.float32).reshape(-1) for o in outs])
    want = mx.concatenate([o.astype(mx.float32).reshape(-1) for o in wants])
    return float(mx.max(mx.abs(got - want)).item())


def run_cell(kernel, B: int, S: int, *, n_q: int, n_kv: int, D: int, dtype, layers: int, steps: int,
             warmup: int) -> AttentionCell:
    from .e2e import copy_bandwidth

    buf = buffers(B, S, n_q=n_q, n_kv=n_kv, D=D, dtype=dtype, layers=layers)
    end, scale = buf.end, D ** -0.5

    def ours():
        return [kernel(q, k, v, buf.kv_len, buf.kv_end, scale=scale, check=False)
                for q, k, v in zip(buf.qs, buf.keys, buf.vals)]

    def masked():
        return [mx.fast.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], scale=scale, mask=buf.mask)
                for q, k, v in zip(buf.qs, buf.keys, buf.vals)]

    def unmasked():
        return [mx.fast.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], scale=scale)
                for q, k, v in zip(buf.qs, buf.keys, buf.vals)]

    def copy():                                  # whole buffers: a row-contiguous elementwise copy
        return [k + 0 for k in buf.keys] + [v + 0 for v in buf.vals]

    err = max_err(ours()[:2], masked()[:2])
    copy_bytes = 2 * sum(k.nbytes + v.nbytes for k, v in zip(buf.keys, buf.vals))     # read + write
    us, copy_tb = timed(dict(kernel=ours, mlx_masked=masked, mlx_unmasked=unmasked, copy=copy), layers, steps,
                        warmup, copy_bytes)
    need = 2 * sum(buf.lens) * n_kv * row_bytes(buf.keys[0])                     # the valid rows, read once
    return AttentionCell(B, S, dtype_name(dtype), kernel.implementation, us, need / copy_bandwidth() * 1e6, copy_tb,
                         err)


def run_quantized_cell(kernels: dict, float_kernel, B: int, S: int, *, n_q: int, n_kv: int, D: int, dtype,
                       layers: int, steps: int, warmup: int, group_size: int) -> QuantizedAttentionCell:
    """kernels: bits -> decode_attention_quantized of that format."""
    from registry.kernels.decode_attention_quantized import decode_attention_quantized_reference

    from .e2e import copy_bandwidth

    buf = buffers(B, S, n_q=n_q, n_kv=n_kv, D=D, dtype=dtype, layers=layers)
    end, scale, base = buf.end, D ** -0.5, SHORT[dtype_name(dtype)]
    packed = {b: ([tuple(mx.quantize(k, group_size=group_size, bits=b)) for k in buf.keys],
                  [tuple(mx.quantize(v, group_size=group_size, bits=b)) for v in buf.vals]) for b in kernels}
    mx.eval(packed)

    def ours(b):
        kp, vp = packed[b]
        return lambda: [kernels[b](q, k, v, buf.kv_len, buf.kv_end, scale=scale, check=False)
                        for q, k, v in zip(buf.qs, kp, vp)]

    def ours_float():
        return [float_kernel(q, k, v, buf.kv_len, buf.kv_end, scale=scale, check=False)
                for q, k, v in zip(buf.qs, buf.keys, buf.vals)]

    def dequantized(b):
        kp, vp = packed[b]
        deq = lambda p: mx.dequantize(*(a[:, :, :end] for a in p), group_size=group_size, bits=b)
        return lambda: [mx.fast.scaled_dot_product_attention(q, deq(k), deq(v), scale=scale, mask=buf.mask)
                        for q, k, v in zip(buf.qs, kp, vp)]

    def copy():
        return [k + 0 for k in buf.keys] + [v + 0 for v in buf.vals]

    err = {f"kernel_{base}": max_err(ours_float()[:2], [
        decode_attention_reference(q, k, v, buf.kv_len, buf.kv_end, scale=scale)
        for q, k, v in zip(buf.qs[:2], buf.keys, buf.vals)])}
    for b in kernels:
        kp, vp = packed[b]
        err[f"kernel_q{b}"] = max_err(ours(b)()[:2], [
            decode_attention_quantized_reference(q, k, v, buf.kv_len, buf.kv_end, bits=b, group_size=group_size,
                                                 scale=scale) for q, k, v in zip(buf.qs[:2], kp, vp)])
    builders = {f"kernel_{base}": ours_float}
    builders.update({f"kernel_q{b}": ours(b) for b in kernels})
    builders.update({f"mlx_dequantized_q{b}": dequantized(b) for b in kernels})
    builders["copy"] = copy
    copy_bytes = 2 * sum(k.nbytes + v.nbytes for k, v in zip(buf.keys, buf.vals))
    us, copy_tb = timed(builders, layers, steps, warmup, copy_bytes)
    valid = 2 * sum(buf.lens) * n_kv                                             # K and V rows, read once
    floor = {base: valid * row_bytes(buf.keys[0]) / copy_bandwidth() * 1e6}
    floor.update({f"q{b}": valid * row_bytes(packed[b][0][0]) / copy_bandwidth() * 1e6 for b in kernels})
    impl = ", ".join(sorted({k.implementation for k in (*kernels.values(), float_kernel)}))
    return QuantizedAttentionCell(B, S, dtype_name(dtype), impl, us, floor, copy_tb, err, group_size)


def run(cells=CELLS, dtype=mx.bfloat16, *, n_q=32, n_kv=8, D=128, layers=8, steps=20, warmup=3, quantized=False,
        group_size=64, progress=None):
    manifest, backend = load_manifest(), backend_of()
    kernel = DecodeAttentionKernel.build(manifest.kernel("decode_attention"),
                                         DecodeAttentionKernel.context_for(None, backend))
    if quantized:
        Q = DecodeAttentionQuantizedKernel
        kernels = {b: Q.build(manifest.kernel("decode_attention_quantized"),
                              Q.context_for(PoolFormat(b, group_size), backend)) for b in BITS}
    out = []
    for B, S in cells:
        shape = dict(n_q=n_q, n_kv=n_kv, D=D, dtype=dtype, layers=layers, steps=steps, warmup=warmup)
        if quantized:
            cell = run_quantized_cell(kernels, kernel, B, S, group_size=group_size, **shape)
            tol = {k: (TOL if k.startswith("kernel_" + SHORT[cell.dtype]) else QUANT_TOL)[cell.dtype]
                   for k in cell.max_err}
            bad = {k: v for k, v in cell.max_err.items() if v > tol[k]}
            against = "its reference"
        else:
            cell = run_cell(kernel, B, S, **shape)
            bad = {"decode_attention": cell.max_err} if cell.max_err > TOL[cell.dtype] else {}
            tol = {"decode_attention": TOL[cell.dtype]}
            against = "MLX's masked attention"
        if bad:
            raise SystemExit(f"at B={B} S={S}, disagreeing with {against}: "
                             + ", ".join(f"{k} max error {v:.3g} > {tol[k]}" for k, v in bad.items()))
        out.append(cell)
        if progress:
            progress(cell)
        mx.clear_cache()
    return out


def _floors(c: AttentionCell) -> str:
    f = c.floor_us_per_layer
    return " ".join(f"{k} {v:.1f}" for k, v in f.items()) if isinstance(f, dict) else f"{f:.1f}"


def row(c: AttentionCell) -> str:
    d = c.to_json()
    f = d["fraction_of_floor"]
    err = c.max_err
    return (f"B={c.batch:<3} S={c.context:<6} {c.dtype:<9} floor {_floors(c)} us  "
            + "  ".join(f"{k} {v:8.1f} us ({100 * f[k]:5.1f}%)" for k, v in c.us_per_layer.items())
            + "".join(f"  {k}/{SHORT[c.dtype]} {v:.2f}x" for k, v in d.get("speedup", {}).items())
            + f"  copy {c.copy_tb_per_s:.2f} TB/s  err "
            + (" ".join(f"{k} {v:.2g}" for k, v in err.items()) if isinstance(err, dict) else f"{err:.2g}")
            + f"  [{c.implementation}]")


def table(meta: dict, cells: list[dict]) -> str:
    """The text report of a run's JSON (meta: its fields but `cells`), as docs/benchmarks/micro-*.txt."""
    quantized = meta.get("kernel") == "decode_attention_quantized"
    c0 = cells[0]
    short = SHORT[c0["dtype"]]
    h = meta.get("heads", {})
    lines = [f"{meta.get('kernel', 'decode_attention')} micro on {meta['host']} ({meta['device']}, MLX "
             f"{meta['mlx']}), {meta['date']}, commit {meta['commit']}",
             f"command: {meta['command']}",
             f"{c0['dtype']}, {h.get('n_q', '?')} query / {h.get('n_kv', '?')} KV heads, head_dim "
             f"{h.get('head_dim', '?')}"
             f", one query token; head-major buffers of S + 256 rows; even rows S keys, odd rows 3S/4 (left padding); "
             f"us per layer = whole {meta.get('layers', '?')}-layer step / {meta.get('layers', '?')}, median of "
             f"{meta.get('steps', '?')} steps.",
             "floor = the valid rows' K/V bytes read once" + (
                 f" (per format: {short} rows, or the {c0.get('group_size')}-group quantized rows' words, scales and "
                 "biases)" if quantized else "")
             + f" at {meta['copy_tb_per_s']:.3g} TB/s, the copy bandwidth of one "
             + ("256 MiB" if "cpu" in meta["device"] else "2 GiB") + " buffer measured in the same run.",
             ""]
    cases = list(c0["us_per_layer"])
    ratios = ([(f"q{b} vs {short} (floor)", f"kernel_{short}", f"kernel_q{b}") for b in BITS] if quantized else
              [("kernel vs masked", "mlx_masked", "kernel"), ("vs unmasked", "mlx_unmasked", "kernel")])
    floors = list(c0["floor_us_per_layer"]) if quantized else ["floor"]
    head = (["B", "S"] + [f"floor {k} us" if quantized else "floor us" for k in floors]
            + [f"{k} us (share)" for k in cases] + [r[0] for r in ratios])
    body = []
    for c in cells:
        fl = c["floor_us_per_layer"]
        us, share = c["us_per_layer"], c["fraction_of_floor"]
        body.append([str(c["batch"]), str(c["context"])]
                    + ([f"{fl[k]:.1f}" for k in floors] if quantized else [f"{fl:.1f}"])
                    + [f"{us[k]:.1f} ({100 * share[k]:3.0f}%)" for k in cases]
                    + [f"{us[a] / us[b]:.2f}x" + (f" ({c['floor_speedup'][b[-2:]]:.2f}x)" if quantized else "")
                       for _, a, b in ratios])
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head] + body]
    lines.append("")
    if quantized:
        lines += [f"max |{k} - reference| per cell: " + ", ".join(f"{c['max_err'][k]:.2g}" for c in cells)
                  for k in c0["max_err"]]
    else:
        lines.append("max |kernel - MLX masked| per cell: " + ", ".join(f"{c['max_err']:.2g}" for c in cells))
    if "launcher" in meta:
        lines.append("launcher over the run: " + ", ".join(f"{v} {k}" for k, v in meta["launcher"].items()))
    lines.append("implementation: " + ", ".join(sorted({c["implementation"] for c in cells})))
    lines.append("(MLX's unmasked call attends to the padding rows too: a speed reference, not an equal result.)"
                 if not quantized else
                 f"(qN vs {short}: kernel_{short}'s time over kernel_qN's, in parentheses the floors' ratio, the most "
                 "reading fewer bytes can give; issue 35's end-to-end targets: 8-bit >= 1.2x, 4-bit >= 1.4x the bf16 "
                 "drop-in's tokens/s.)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--cells", help="comma list of BxS (default: " + ",".join(f"{b}x{s}" for b, s in CELLS)
                   + "; on the CPU " + ",".join(f"{b}x{s}" for b, s in CPU_CELLS) + ")")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quantized", action="store_true",
                   help="decode_attention_quantized at 8 and 4 bits against decode_attention (module docstring)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128),
                   help="--quantized: features per scale and bias (default 64)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--txt", dest="txt_path", help="also write the text table here (it is printed either way)")
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
    if a.group_size is not None and not a.quantized:
        p.error("--group-size: only with --quantized")
    group_size = a.group_size or 64
    n_q, n_kv, D = 32, 8, 128
    t0 = time.time()
    res = run(cells, getattr(mx, a.dtype), n_q=n_q, n_kv=n_kv, D=D, layers=a.layers, steps=a.steps,
              quantized=a.quantized, group_size=group_size, progress=lambda c: print(row(c), flush=True))
    from registry.native import stats

    launcher = {k: v for k, v in stats().items() if k in ("launches", "copies", "syncs")}
    print("launcher:", launcher)
    import datetime
    import platform
    import subprocess

    from .e2e import copy_bandwidth

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                device=str(mx.default_device()), mlx=mx.__version__, commit=a.commit or commit or "?",
                command="python -m benchmarks.attention " + " ".join(argv if argv is not None else sys.argv[1:]),
                kernel="decode_attention_quantized" if a.quantized else "decode_attention",
                heads=dict(n_q=n_q, n_kv=n_kv, head_dim=D), layers=a.layers, steps=a.steps,
                copy_tb_per_s=copy_bandwidth() / 1e12, launcher=launcher)
    cells_json = [c.to_json() for c in res]
    text = table(meta, cells_json)
    print("\n" + text, end="")
    if a.txt_path:
        with open(a.txt_path, "w") as f:
            f.write(text)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(dict(meta, cells=cells_json, seconds=time.time() - t0), f, indent=1)


if __name__ == "__main__":
    main()
