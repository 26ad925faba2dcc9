#!/bin/bash
# The GPU host runs recorded in docs/gpu-runs.md: build registry._ext against the gpu-kit's MLX CUDA
# wheel, compile every kernel of kernels.yaml for the device's arch, then run tests on the GPU.
# Usage on the host, after `bash .gpu-kit/b/install.sh`:
#   bash tests/gpu/run_on_host.sh --all          # the whole suite (pytest tests): junit + summary line
#   bash tests/gpu/run_on_host.sh --build-only   # extension + artifacts only
#   bash tests/gpu/run_on_host.sh [pytest args]  # the native tests and tests/gpu, plus any args
# Logs, junit.xml and summary.txt go to $OUT when set (else /tmp). MLX_AOT_COMMIT names the commit
# in the summary when the tree has no .git. MLX_AOT_BUILD_DIR is the extension's cmake build directory
# (default /tmp/mlx_aot_build): one per tree when several trees are built on one host
# (benchmarks/micro_ab.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}"
commit="${MLX_AOT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
build="${MLX_AOT_BUILD_DIR:-/tmp/mlx_aot_build}"
echo "== $(date -u +%FT%TZ) commit $commit"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
cmake -S csrc -B "$build" -DPython_EXECUTABLE="$(command -v python3)" \
      -DMLX_AOT_OUTPUT_DIR="$PWD/registry" -DMLX_AOT_BACKEND=cuda -DCMAKE_BUILD_TYPE=Release >"$log/cmake.log" 2>&1 \
  && cmake --build "$build" --parallel 16 >>"$log/cmake.log" 2>&1 || { tail -40 "$log/cmake.log"; exit 1; }
arch=$(python3 -c 'import registry._ext as e; print(e.cuda_device_arch(0))')
echo "ext: cuda $(python3 -c 'import registry._ext as e; print(e.built_with_cuda())') $arch"
python3 -m build_tools compile --target cuda --arch "$arch"
python3 -m build_tools compile --target cpu
# The suite's native_artifacts fixture reuses these (checked fresh by content) rather than every
# pytest-xdist worker compiling every kernel again.
export MLX_AOT_TEST_ARTIFACTS="$PWD/registry/_artifacts"
case "${1:-}" in
  --build-only) exit 0 ;;
  --all)
    shift
    set +e
    python3 -m pytest -q -p no:cacheprovider --junitxml="$log/junit.xml" tests "$@" 2>&1 | tee "$log/pytest.log"
    rc=${PIPESTATUS[0]}
    set -e
    python3 - "$log/junit.xml" "$commit" >"$log/summary.txt" <<'PY'
import datetime, socket, subprocess, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = lambda k: sum(int(s.get(k, 0)) for s in suites)
failed, skipped = n("failures") + n("errors"), n("skipped")
passed = n("tests") - failed - skipped
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip() or "no GPU"
print(f"whole suite: {passed} passed, {failed} failed, {skipped} skipped at commit {sys.argv[2]} "
      f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {socket.gethostname()}: {gpu})")
PY
    cat "$log/summary.txt"
    exit "$rc" ;;
esac
python3 -m pytest -q -x -p no:cacheprovider --junitxml="$log/junit.xml" \
  tests/test_native_rope_pool_fused.py tests/test_inplace_soak.py tests/gpu "$@" 2>&1 | tee "$log/pytest.log"
