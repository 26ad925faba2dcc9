#!/bin/bash
# A/B of the launcher's host cost against another commit's, on one GPU host, in ABBA order (the host's
# speed drifts between minutes): each step runs `python -m benchmarks.node_cost --steps 40` and the
# qk_norm_rope_pool_fused micro (`bench --kernel ... --shapes llama-8b,qwen3-0.6b --tokens 1,8 --dtypes
# bfloat16`) on this tree (new), then the other (old), then old, new.
#   bash benchmarks/micro_ab.sh OLD_TREE NEW_COMMIT OLD_COMMIT > ab.txt
# OLD_TREE: the other commit exported (git archive OLD | tar x -C OLD_TREE). Unlike e2e_ab.sh it need not
# share this tree's kernels: each tree without a built extension is built here by its own
# tests/gpu/run_on_host.sh --build-only (the extension in a build directory of its own, its kernels for
# this device's arch). One untimed micro runs first.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 OLD_TREE NEW_COMMIT OLD_COMMIT" >&2; exit 2; }
old=$(realpath "$1") new_commit=$2 old_commit=$3
[ -d "$old/registry" ] || { echo "$0: OLD_TREE $1 has no registry/ (export the old commit there)" >&2; exit 2; }
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
build() {  # build TREE NAME: registry._ext and the kernels, unless the tree has them
  (cd "$1" && python3 -c 'import registry._ext' 2>/dev/null) && return 0
  # The tree's own recipe, in a build directory of its own. A tree whose run_on_host.sh predates
  # MLX_AOT_BUILD_DIR builds in /tmp/mlx_aot_build, where this tree's suite may have left a CMake
  # cache of another source directory, which stops cmake: that directory goes first.
  grep -q MLX_AOT_BUILD_DIR "$1/tests/gpu/run_on_host.sh" 2>/dev/null || rm -rf /tmp/mlx_aot_build
  (cd "$1" && MLX_AOT_BUILD_DIR="/tmp/mlx_aot_ab_$2" bash tests/gpu/run_on_host.sh --build-only \
     >"/tmp/mlx_aot_ab_$2.log" 2>&1) || { tail -20 "/tmp/mlx_aot_ab_$2.log"; echo "$0: building $1 failed" >&2; exit 1; }
}
micro() {  # micro TREE COMMIT: the qk_norm micro's lines
  (cd "$1" && python3 -m build_tools bench --kernel qk_norm_rope_pool_fused --shapes llama-8b,qwen3-0.6b \
     --tokens 1,8 --dtypes bfloat16 --commit "$2") | grep "^qk_norm_rope_pool_fused "
}
build . new
build "$old" old
micro . "$new_commit" >/dev/null   # untimed: the first micro after the builds reads low
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU'): new $new_commit, old $old_commit"
for step in new old old new; do
  dir=.; commit=$new_commit
  [ "$step" = old ] && { dir=$old; commit=$old_commit; }
  echo "== $step ($commit) $(date -u +%T) node_cost, us per node"
  (cd "$dir" && PYTHONPATH=. python3 -m benchmarks.node_cost --steps 40) | grep -vE "^#|^kind"
  echo "== $step ($commit) micro: fused us, mlx us, speedup, eval speedup (per layer)"
  micro "$dir" "$commit"
done
