#!/bin/bash
# BEFORE: a worktree of the commit before the change (git worktree add /tmp/fcp-before 731f1e9); runs as root (the testbed)
# issue 15 before/after: e2e --quick, three-sites and uniform, uniform and opfence (no compression), interleaved
for round in 1 2; do
  for code in after before; do
    if [ $code = after ]; then dir=/work/main; else dir=${BEFORE:-/tmp/fcp-before}; fi
    echo "== $code round $round $(date)"
    cd $dir && PYTHONPATH=$dir/src flock /tmp/fusionllm-bench.lock /work/main/.venv/bin/python benchmarks/e2e.py --quick --clusters three-sites uniform --systems uniform opfence --out ${OUT:-/tmp/e2e-ab}/$code-$round 2>&1 | tail -8
  done
done
echo "== done $(date)"
