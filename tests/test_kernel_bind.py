"""PoolKernel.bind (a shape signature's launch as a callable) and last_bound (a caller's stream of
launches), as the drop-in cache uses them: same results as the plain call, validation once per
signature, other shapes and dtypes refused by the native launcher and then bound anew (buffer
growth, another chunk length); placeholders and the model-code memo of the cache's hot path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from registry import KernelArgumentError
from registry.integrations import mlx_lm_cache as mc
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, make_prompt_cache
from registry.kernels.rope_pool_fused import RopePoolFusedKernel
from registry.rope import RopeConfig
from tests.rope_cases import make_case
from tests.test_native_rope_pool_fused import native_kernel


def _same(got, want):
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), np.array(w))


def test_bound_native_launch_matches_the_call_and_refuses_other_shapes(native_artifacts):
    kernel = native_kernel(RopeConfig(64))
    case = make_case(4, 4, 2, 64, 16, "float32", [3, 0, 7, 9])
    want = kernel(*case)
    bound = kernel.bind(*case)
    _same(bound(*case), want)
    assert len(kernel._plans) == 1                       # bind and the call share the plan
    other = make_case(1, 4, 2, 64, 16, "float32", [3])
    with pytest.raises(ValueError, match="the plan was made for"):
        bound(*other)
    f16 = make_case(4, 4, 2, 64, 16, "float16", [3, 0, 7, 9])
    with pytest.raises(ValueError, match="dtype"):
        bound(*f16)


def test_bound_reference_is_the_reference_and_bind_validates():
    kernel = RopePoolFusedKernel(RopeConfig(64), backend="cpu")    # no launcher: the reference path
    case = make_case(4, 4, 2, 64, 16, "float32", [3, 0, 7, 9])
    bound = kernel.bind(*case)
    _same(bound(*case), kernel.reference(*case))
    with pytest.raises(KernelArgumentError, match="head_dim=63 must be even|rotary_dims"):
        kernel.bind(*make_case(4, 4, 2, 63, 16, "float32", [3, 0, 7, 9]))
    with pytest.raises(KernelArgumentError, match="expected 7 arguments"):
        kernel.bind(*case[:6])


def test_placeholders_share_nan_but_resolve_independently():
    x = mx.zeros((1, 2, 1, 8))
    a, b = mc._placeholder(x), mc._placeholder(x)
    assert a is not b
    mc.rebind(a, mx.ones((1, 2, 1, 8)))
    assert np.all(np.array(a) == 1) and np.all(np.isnan(np.array(b)))
    assert np.all(np.isnan(np.array(mc._placeholder(x))))


def test_model_code_memo_agrees_with_the_module_test():
    for name in ("mlx_lm.models.llama", "mlx_lm.models.cache", "mlx_lm.generate", "__main__", ""):
        assert mc._model_code(name) == mc._model_code(name) == mc._is_model_code(name)


def test_new_signatures_are_bound_anew(native_artifacts):
    """Prefill chunks of two lengths and decode past the 256-row growth each get their own bound
    launch, and the fused cache still gives mlx-lm's own keys and values."""
    mx.random.seed(0)
    model = build_model(ARCHS["llama"], dtype=mx.float32)
    fused, own = make_prompt_cache(model), mc._stock.make_prompt_cache(model)
    for chunk in ([1] * 200, [2] * 50, *([[3]] * 10)):
        for c in (fused, own):
            mx.eval(model(mx.array([chunk]), cache=c))
    f = mc.fused_model(model).fusions[0]
    assert f.calls["fused"] == 12 and not f.calls["stock"]
    owner, last = fused[0].__dict__["_launch"]          # the cache's own stream of launches
    assert owner is f and last.kernel is f.kernel and fused[0].keys.shape[2] == 512   # grew from 256
    for a, b in zip(fused, own):
        assert a.offset == b.offset == 260
        np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), atol=1e-5)


def test_last_bound_rebinds_on_a_new_signature(native_artifacts):
    kernel = native_kernel(RopeConfig(64))
    call = kernel.last_bound()
    prefill = make_case(4, 4, 2, 64, 16, "float32", [3, 0, 7, 9])
    decode = make_case(1, 4, 2, 64, 16, "float32", [5], seed=1)
    for case in (prefill, decode, prefill):
        _same(call(*case), kernel(*case, check_slots=False))
    assert len(kernel._plans) == 2
    with pytest.raises(KernelArgumentError, match="positions must be int32"):
        call(*prefill[:3], prefill[3].astype(mx.int64), *prefill[4:])      # refused, then validated


def test_last_bound_of_a_reference_kernel_validates_every_signature():
    kernel = RopePoolFusedKernel(RopeConfig(64), backend="cpu")
    call = kernel.last_bound()
    case = make_case(4, 4, 2, 64, 16, "float32", [3, 0, 7, 9])
    _same(call(*case), kernel.reference(*case))
    with pytest.raises(KernelArgumentError, match="positions must be int32"):
        call(*case[:3], case[3].astype(mx.int64), *case[4:])
