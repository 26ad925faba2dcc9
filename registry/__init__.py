"""mlx-aot-kernels: the kernel registry MLX inference engines import.

    import registry
    kernels = registry.build_kernel_set(sample_attn=attn, n_kv_heads=8, head_dim=128)
    print(kernels.explain())
"""

import logging as _logging

try:
    import mlx.core as _mx  # noqa: F401
except ImportError as _e:  # Linux `pip install mlx` alone has no libmlx
    raise ImportError(f"mlx-aot-kernels needs MLX with its library ({_e}); on Linux install "
                      f"mlx-aot-kernels[cpu] or mlx-aot-kernels[cuda13] (mlx[cpu] / mlx[cuda13] == 0.32.4)") from _e

from . import envs as _envs
from .core import KernelRegistry, KernelSet, SelectionContext, build_kernel_set, default_registry
from .errors import (ArtifactError, EnvError, KernelArgumentError, ManifestError, MlxAotError,
                     NativeUnavailableError)
from .kernels.kv_pool_store import kv_pool_store, kv_pool_store_reference
from .kernels.qk_norm_rope_pool_fused import qk_norm_rope_pool_fused, qk_norm_rope_pool_fused_reference
from .kernels.rope_pool_fused import rope_pool_fused, rope_pool_fused_reference
from .manifest import KernelSpec, load_manifest
from .norm import NormConfig, UnsupportedNorm, normalize_qk_norm
from .rope import RopeConfig, UnsupportedRope, normalize_rope

from ._version import __version__

_level = _envs.get_log_level()
if _level:
    _logging.getLogger("registry").setLevel(_level)

__all__ = ["KernelRegistry", "KernelSet", "SelectionContext", "build_kernel_set", "default_registry",
           "ArtifactError", "EnvError", "KernelArgumentError", "ManifestError", "MlxAotError",
           "NativeUnavailableError", "rope_pool_fused", "rope_pool_fused_reference", "kv_pool_store",
           "kv_pool_store_reference", "qk_norm_rope_pool_fused", "qk_norm_rope_pool_fused_reference", "KernelSpec",
           "load_manifest", "RopeConfig", "UnsupportedRope", "normalize_rope", "NormConfig", "UnsupportedNorm",
           "normalize_qk_norm", "__version__"]
