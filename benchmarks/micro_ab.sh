#!/bin/bash
# A/B of the launcher's host cost against another commit's, on one GPU host, in ABBA order (the host's
# speed drifts between minutes): each step runs `python -m benchmarks.node_cost --steps 40` and the
# qk_norm_rope_pool_fused micro (`bench --kernel ... --shapes llama-8b,qwen3-0.6b --tokens 1,8 --dtypes
# bfloat16`) on this tree (new), then the other (old), then old, new.
#   bash benchmarks/micro_ab.sh OLD_TREE NEW_COMMIT OLD_COMMIT > ab.txt
# OLD_TREE: the other commit exported (git archive OLD | tar x -C OLD_TREE). Unlike e2e_ab.sh it need not
# share this tree's kernels: each tree without a built extension is built here (the extension in a
# build directory of its own, its kernels for this device's arch), as tests/gpu/run_on_host.sh does.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 OLD_TREE NEW_COMMIT OLD_COMMIT" >&2; exit 2; }
old=$(realpath "$1") new_commit=$2 old_commit=$3
[ -d "$old/registry" ] || { echo "$0: OLD_TREE $1 has no registry/ (export the old commit there)" >&2; exit 2; }
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
build() {  # build TREE NAME: registry._ext and the kernels, unless the tree has them
  (cd "$1" && python3 -c 'import registry._ext' 2>/dev/null) && return 0
  (cd "$1" && cmake -S csrc -B "/tmp/mlx_aot_ab_$2" -DPython_EXECUTABLE="$(command -v python3)" \
      -DMLX_AOT_OUTPUT_DIR="$PWD/registry" -DMLX_AOT_BACKEND=cuda -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build "/tmp/mlx_aot_ab_$2" --parallel 16 >/dev/null \
    && arch=$(python3 -c 'import registry._ext as e; print(e.cuda_device_arch(0))') \
    && python3 -m build_tools compile --target cuda --arch "$arch" >/dev/null) \
    || { echo "$0: building $1 failed" >&2; exit 1; }
}
build . new
build "$old" old
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU'): new $new_commit, old $old_commit"
for step in new old old new; do
  dir=.; commit=$new_commit
  [ "$step" = old ] && { dir=$old; commit=$old_commit; }
  echo "== $step ($commit) $(date -u +%T) node_cost, us per node"
  (cd "$dir" && PYTHONPATH=. python3 -m benchmarks.node_cost --steps 40) | grep -vE "^#|^kind"
  echo "== $step ($commit) micro: fused us, mlx us, speedup, eval speedup (per layer)"
  (cd "$dir" && python3 -m build_tools bench --kernel qk_norm_rope_pool_fused --shapes llama-8b,qwen3-0.6b \
     --tokens 1,8 --dtypes bfloat16 --commit "$commit") | grep "^qk_norm_rope_pool_fused "
done
