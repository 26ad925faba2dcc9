"""RoPE normalisation over the real RoPE classes of MLX and mlx-lm 0.32.2: each RopeConfig must
reproduce the module's own output through the reference path (mx.fast.rope with the config)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from registry.integrations.mlx_lm import import_mlx_lm_module as mlx_lm
from registry.kernels._rope import rotate as _rotate
from registry.rope import RopeConfig, UnsupportedRope, normalize_rope
from tests._oracle import rotate_numpy


def rope_utils():
    return mlx_lm("rope_utils")


def _modules():
    ru = rope_utils()
    hunyuan = mlx_lm("hunyuan")
    cfg_l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    cfg_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}
    return {
        "nn.RoPE": nn.RoPE(32, traditional=False, base=10000.0),
        "nn.RoPE traditional partial scaled": nn.RoPE(16, traditional=True, base=500.0, scale=0.25),
        "Llama3RoPE": ru.initialize_rope(32, 500000.0, False, cfg_l3, 131072),
        "YarnRoPE": ru.initialize_rope(32, 10000.0, False, cfg_yarn, 16384),
        "YarnRoPE traditional": ru.initialize_rope(32, 10000.0, True, cfg_yarn, 16384),
        "linear": ru.initialize_rope(32, 10000.0, False, {"rope_type": "linear", "factor": 8.0}, 4096),
        "SuScaledRoPE partial": ru.SuScaledRoPE(24, base=10000.0, max_position_embeddings=131072,
                                                original_max_position_embeddings=4096,
                                                long_factor=[1.0 + i / 10 for i in range(12)]),
        "ProportionalRoPE": ru.ProportionalRoPE(32, rotated_dims=8, base=10000.0),
        "DynamicNTKAlphaRoPE": hunyuan.DynamicNTKAlphaRoPE(32, base=10000.0, scaling_alpha=1000.0),
    }


MODULE_NAMES = ["nn.RoPE", "nn.RoPE traditional partial scaled", "Llama3RoPE", "YarnRoPE", "YarnRoPE traditional",
                "linear", "SuScaledRoPE partial", "ProportionalRoPE", "DynamicNTKAlphaRoPE"]


@pytest.fixture(scope="module")
def modules():
    return _modules()


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_config_reproduces_module(modules, name):
    module = modules[name]
    cfg = normalize_rope(module)
    D, H, T = 32, 3, 6
    x = mx.array(np.random.default_rng(1).standard_normal((1, H, T, D)).astype(np.float32))
    expected = module(x, offset=5)                                     # [1, H, T, D], positions 5..10
    positions = mx.arange(5, 5 + T, dtype=mx.int32)
    got = _rotate(x[0].transpose(1, 0, 2), positions, cfg).transpose(1, 0, 2)[None]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5, rtol=1e-5)
    oracle = rotate_numpy(np.array(x[0].transpose(1, 0, 2)), np.arange(5, 5 + T), cfg)
    np.testing.assert_allclose(oracle.transpose(1, 0, 2)[None], np.array(expected), atol=5e-5, rtol=1e-4)


def test_specific_fields(modules):
    su = normalize_rope(modules["SuScaledRoPE partial"])
    assert (su.rotary_dims, su.traditional, su.base) == (24, False, None)
    assert su.mscale == pytest.approx(modules["SuScaledRoPE partial"]._scale)
    prop = normalize_rope(modules["ProportionalRoPE"])
    assert prop.rotary_dims == 32 and sum(math.isinf(p) for p in prop.periods) == 12
    assert np.count_nonzero(prop.inv_freq() == 0) == 12
    lin = normalize_rope(modules["linear"])
    assert lin.pos_scale == pytest.approx(1 / 8) and lin.base == 10000.0
    yarn = normalize_rope(modules["YarnRoPE"])
    assert yarn.has_periods and yarn.mscale == pytest.approx(modules["YarnRoPE"].mscale)


def test_rejections():
    ru = rope_utils()
    dyn = ru.initialize_rope(32, 10000.0, False, {"rope_type": "dynamic", "factor": 2.0}, 4096)
    with pytest.raises(UnsupportedRope, match="base from the sequence length"):
        normalize_rope(dyn)
    with pytest.raises(UnsupportedRope, match="no RoPE"):
        normalize_rope(None)

    class Custom(nn.Module):
        pass
    with pytest.raises(UnsupportedRope, match="unknown RoPE class .*Custom: supported are mlx.nn.RoPE"):
        normalize_rope(Custom())

    class SubRoPE(nn.RoPE):  # a subclass may override __call__: not trusted
        pass
    with pytest.raises(UnsupportedRope, match="unknown RoPE class"):
        normalize_rope(SubRoPE(16))


@pytest.mark.parametrize("kwargs, message", [
    (dict(rotary_dims=7), "positive even integer"),
    (dict(rotary_dims=0), "positive even integer"),
    (dict(rotary_dims=8, base=None), "exactly one of base and periods"),
    (dict(rotary_dims=8, periods=(1.0,) * 4), "exactly one of base and periods"),
    (dict(rotary_dims=8, base=None, periods=(1.0,) * 3), "periods has 3 entries, expected rotary_dims/2 = 4"),
    (dict(rotary_dims=8, base=-1.0), "base=-1.0"),
    (dict(rotary_dims=8, pos_scale=float("nan")), "pos_scale=nan"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(UnsupportedRope, match=message.replace("(", r"\(").replace(")", r"\)")):
        RopeConfig(**kwargs)
