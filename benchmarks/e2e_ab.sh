#!/bin/bash
# A/B of this tree against another commit's, on one host, in ABBA order: the host's speed drifts
# between minutes (docs/benchmarks/README.md, "Reading the numbers"), so each bench runs new, old, then later old, new.
#   bash benchmarks/e2e_ab.sh OLD_TREE OUT_DIR NEW_COMMIT OLD_COMMIT "BENCH ARGS" ["BENCH ARGS" ...]
# OLD_TREE: the other commit exported (git archive OLD | tar x -C OLD_TREE) with this tree's built
# registry/_ext*.so and registry/_artifacts copied in, which holds only where the kernels' sources
# are the same (artifacts are verified against them when loaded). Each "BENCH ARGS" is a string of
# `python -m build_tools bench --e2e` options; run n writes OUT_DIR/n-{new,old}-{set}.json and its
# whole output to .log beside it; its table and target lines go to stdout. A bench that fails stops
# the A/B with its own error.
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 OLD_TREE OUT_DIR NEW_COMMIT OLD_COMMIT \"BENCH ARGS\" [...]" >&2; exit 2; }
old=$1 out=$2 new_commit=$3 old_commit=$4
shift 4
[ -d "$old/registry" ] || { echo "$0: OLD_TREE $old has no registry/ (export the old commit there)" >&2; exit 2; }
mkdir -p "$out"
out=$(realpath "$out")
sets=("$@")
order=()
for i in "${!sets[@]}"; do order+=("new $i" "old $i"); done
for ((i = ${#sets[@]} - 1; i >= 0; i--)); do order+=("old $i" "new $i"); done
n=0
for step in "${order[@]}"; do
  read -r tree i <<<"$step"
  n=$((n + 1))
  dir=.; commit=$new_commit
  [ "$tree" = old ] && { dir=$old; commit=$old_commit; }
  echo "== $n $tree set $i ($commit) $(date -u +%T)"
  log="$out/$n-$tree-$i.log"
  if ! (cd "$dir" && python3 -m build_tools bench --e2e ${sets[$i]} --commit "$commit" \
        --json "$out/$n-$tree-$i.json") >"$log" 2>&1; then
    tail -5 "$log" >&2
    echo "$0: run $n ($tree tree, \"${sets[$i]}\") failed; its output is in $log" >&2
    exit 1
  fi
  grep -E "^(llama|qwen3|gemma3|tiny)|^(NOT )?MET" "$log" || true
done
