#!/bin/bash
# Tokens/s of two checkouts side by side, interleaved (after, before, after, before ...), as root (the testbed):
#   git worktree add /tmp/fcp-before <commit before the change>
#   BEFORE=/tmp/fcp-before OUT=/tmp/e2e-ab ROUNDS=2 experiments/e2e_before_after.sh
# Each run: benchmarks/e2e.py --quick --clusters $CLUSTERS --systems $SYSTEMS, with the python of this checkout's .venv and each
# checkout's own src (PYTHONPATH). The JSONs land in $OUT/<after|before>-<round>/.
AFTER=$(cd "$(dirname "$0")/.." && pwd)
CLUSTERS=${CLUSTERS:-three-sites}
SYSTEMS=${SYSTEMS:-uniform opfence opfence+adatopk hierarchical}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for code in after before; do
    if [ $code = after ]; then dir=$AFTER; else dir=${BEFORE:-/tmp/fcp-before}; fi
    echo "== $code round $round $(date -u +%H:%M:%S) ($(git -C "$dir" rev-parse --short HEAD))"
    # shellcheck disable=SC2086
    (cd "$dir" && PYTHONPATH=$dir/src flock /tmp/fusionllm-bench.lock "$AFTER/.venv/bin/python" benchmarks/e2e.py --quick \
      --clusters $CLUSTERS --systems $SYSTEMS --out "${OUT:-/tmp/e2e-ab}/$code-$round" 2>&1 | tail -8)
  done
done
echo "== done $(date -u +%H:%M:%S)"
