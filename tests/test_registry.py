"""Kernel selection: env flag, requires, prefer, Python check, reasons, explain() and logging."""

from __future__ import annotations

import copy
import logging

import mlx.core as mx
import mlx.nn as nn
import pytest

import registry
from registry import KernelRegistry, ManifestError
from registry.core import backend_of
from registry.errors import EnvError
from tests.test_manifest import GOOD, write


class Attn(nn.Module):
    def __init__(self, rope=None, n_heads=8, mla=False):
        super().__init__()
        self.n_heads = n_heads
        self.rope = rope if rope is not None else nn.RoPE(32)
        self.q_proj = nn.Linear(8, 8)
        if mla:
            self.kv_lora_rank = 16


def toy_registry(tmp_path, **changes):
    data = copy.deepcopy(GOOD)
    data["kernels"][0].update(changes)
    return KernelRegistry.from_yaml(write(tmp_path, data))


def test_selected_with_context(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_AOT_TOY", raising=False)
    kset = toy_registry(tmp_path).build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    assert kset.selected_kernel_names == ("toy",)
    assert kset.toy.ctx.rope.rotary_dims == 32 and kset.toy.ctx.n_heads == 8
    assert kset.toy.ctx.dtype == "float32" and kset.toy.ctx.backend == backend_of(None)
    assert kset.rejections == {}
    assert " ".join(kset.explain().split()).endswith("toy = toy: selected [reference] (toy)")


def test_env_flag_off_and_default_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_AOT_TOY", "0")
    kset = toy_registry(tmp_path).build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    assert kset.toy is None and kset.rejections["toy"] == "disabled by MLX_AOT_TOY=0"
    monkeypatch.delenv("MLX_AOT_TOY")
    kset = toy_registry(tmp_path, enable={"env": "MLX_AOT_TOY", "default": False}).build_kernel_set(
        sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    assert kset.rejections["toy"] == "off by default; set MLX_AOT_TOY=1 to enable"


def test_bad_env_value_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_AOT_TOY", "maybe")
    with pytest.raises(EnvError, match="MLX_AOT_TOY='maybe'"):
        toy_registry(tmp_path).build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)


def test_requirement_reason_is_formatted(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_AOT_TOY", raising=False)
    reg = toy_registry(tmp_path)

    class Weird(nn.Module):
        pass
    kset = reg.build_kernel_set(sample_attn=Attn(rope=Weird()), n_kv_heads=2, head_dim=32)
    assert kset.rejections["toy"].startswith("unknown RoPE class")
    kset = reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=33)
    assert kset.rejections["toy"] == "requirement `head_dim % 2 == 0` is false"


def test_prefer_is_skipped_when_forced_on(tmp_path, monkeypatch):
    reg = toy_registry(tmp_path, prefer=[{"expr": "backend == 'no-such-backend'", "reason": "slow on {backend}"}])
    monkeypatch.delenv("MLX_AOT_TOY", raising=False)
    kset = reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    assert kset.rejections["toy"] == (f"not faster here: slow on {backend_of(None)} "
                                      f"(set MLX_AOT_TOY=1 to force it on)")
    monkeypatch.setenv("MLX_AOT_TOY", "1")
    assert reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32).toy is not None


def test_python_check_must_give_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_AOT_TOY", raising=False)
    reg = toy_registry(tmp_path, check="tests.toy_wrapper:check_small_heads")
    assert reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32).toy is not None
    kset = reg.build_kernel_set(sample_attn=Attn(rope=nn.RoPE(64)), n_kv_heads=2, head_dim=128)
    assert kset.rejections["toy"] == "head_dim=128 > 64 (toy check)"
    reg = toy_registry(tmp_path, check="tests.toy_wrapper:check_without_reason")
    with pytest.raises(ManifestError, match="check tests.toy_wrapper:check_without_reason said no without a reason"):
        reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)


def test_unresolvable_wrapper_fails_at_load_time(tmp_path):
    # Checked when the manifest loads (validate), without importing the module.
    with pytest.raises(ManifestError, match="kernel 'toy': wrapper: registry.no_such_module:build: module "
                                            "registry.no_such_module not found"):
        toy_registry(tmp_path, wrapper="registry.no_such_module:build")
    with pytest.raises(ManifestError, match="wrapper: tests.no_such_module:build: module 'tests.no_such_module' "
                                            "is outside the registry package"):
        toy_registry(tmp_path, wrapper="tests.no_such_module:build")


def test_unknown_attribute_lists_declared(tmp_path):
    kset = toy_registry(tmp_path).build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    with pytest.raises(AttributeError, match="no kernel attribute 'paged_attention'; declared: toy"):
        kset.paged_attention


@pytest.mark.parametrize("kw, message", [
    (dict(n_kv_heads=0, head_dim=32), "n_kv_heads must be a positive int, got 0"),
    (dict(n_kv_heads=2, head_dim="128"), "head_dim must be a positive int, got '128'"),
])
def test_bad_build_arguments(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        toy_registry(tmp_path).build_kernel_set(sample_attn=Attn(), **kw)


# ----------------------------------------------------------------------------- the real manifest

def test_rope_kernel_selected_for_plain_rope(monkeypatch, caplog):
    monkeypatch.delenv("MLX_AOT_ROPE_POOL_FUSED", raising=False)
    with caplog.at_level(logging.DEBUG, logger="registry"):
        kset = registry.build_kernel_set(sample_attn=Attn(nn.RoPE(32, traditional=True)), n_kv_heads=2,
                                         head_dim=64, dtype=mx.bfloat16)
    assert "rope_pool_fused" in kset.selected_kernel_names   # other kernels may be selected too
    assert kset.rope.rope.rotary_dims == 32 and kset.rope.rope.traditional
    assert kset.rope.implementation in (f"native-{backend_of(None)}", "reference")
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "rope_pool_fused [" in infos[0].getMessage()


def test_rope_kernel_rejections_explained(monkeypatch, caplog):
    monkeypatch.delenv("MLX_AOT_ROPE_POOL_FUSED", raising=False)
    with caplog.at_level(logging.DEBUG, logger="registry"):
        mla = registry.build_kernel_set(sample_attn=Attn(mla=True), n_kv_heads=1, head_dim=64)
    assert mla.rope is None
    assert mla.rejections["rope_pool_fused"].startswith("attention layout is mla")
    assert any(r.levelno == logging.DEBUG and "not selected" in r.getMessage() for r in caplog.records)
    gqa = registry.build_kernel_set(sample_attn=Attn(n_heads=6), n_kv_heads=4, head_dim=64)
    assert gqa.rejections["rope_pool_fused"] == "n_heads=6 is not a multiple of n_kv_heads=4"
    big = registry.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=16)
    assert big.rejections["rope_pool_fused"] == "rotary dims exceed head_dim=16"
    text = big.explain()
    assert "rope_pool_fused: not selected: rotary dims exceed head_dim=16" in text
    monkeypatch.setenv("MLX_AOT_ROPE_POOL_FUSED", "off")
    off = registry.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=64)
    assert off.rejections["rope_pool_fused"] == "disabled by MLX_AOT_ROPE_POOL_FUSED=0"


def test_the_cache_format_reaches_the_context_and_float_kernels_step_aside():
    """kv_bits/kv_group_size/kv_scales_dtype reach the context (explain() names them); every kernel
    that writes float rows requires kv_bits is None, so none is selected for a quantized cache."""
    reg = KernelRegistry.from_yaml()
    float_set = reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32)
    assert float_set.context.kv_bits is None and float_set.rope is not None
    q = reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32, kv_bits=8, kv_group_size=32)
    assert (q.context.kv_bits, q.context.kv_group_size, q.context.kv_scales_dtype) == (8, 32, "float32")
    for name in ("rope_pool_fused", "kv_pool_store", "qk_norm_rope_pool_fused"):
        assert name not in q.kernels
        assert q.rejections[name].startswith("the KV cache is quantized (8-bit)"), q.rejections[name]
    assert "cache=8-bit/group 32 (scales float32)" in q.explain()
    assert float_set.context.quantized(4, 64, mx.bfloat16).kv_scales_dtype == "bfloat16"
    assert q.context.quantized(None).kv_group_size is None
    with pytest.raises(ValueError, match="kv_bits must be a positive int or None, got '8'"):
        reg.build_kernel_set(sample_attn=Attn(), n_kv_heads=2, head_dim=32, kv_bits="8")
