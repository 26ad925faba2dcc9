#!/bin/bash
# The GPU host run recorded in docs/gpu-runs.md: build registry._ext against the gpu-kit's MLX CUDA
# wheel, then run the native tests on the GPU (the CPU suite's native tests use the default device,
# which is the GPU there) and the GPU-only tests, memcheck included. Logs go to $OUT when set.
# Usage on the host, after `bash .gpu-kit/b/install.sh`:  bash tests/gpu/run_on_host.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}"
echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
cmake -S csrc -B /tmp/mlx_aot_build -DPython_EXECUTABLE="$(command -v python3)" \
      -DMLX_AOT_OUTPUT_DIR="$PWD/registry" -DMLX_AOT_BACKEND=cuda -DCMAKE_BUILD_TYPE=Release >"$log/cmake.log" 2>&1 \
  && cmake --build /tmp/mlx_aot_build --parallel 16 >>"$log/cmake.log" 2>&1 || { tail -40 "$log/cmake.log"; exit 1; }
python3 -c 'import registry._ext as e; print("ext: cuda", e.built_with_cuda(), e.cuda_device_arch(0))'
python3 -m build_tools compile --target cuda --arch sm_90
python3 -m pytest -q -x -p no:cacheprovider --junitxml="$log/junit.xml" \
  tests/test_native_rope_pool_fused.py tests/gpu "$@" 2>&1 | tee "$log/pytest.log"
