"""A worker's glibc thresholds: freed memory goes back while a stage is set up, and is reused while it trains."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = """
import resource
import numpy as np
from fusionllm.runtime.worker.process_memory import keep_working_memory, return_freed_memory

def faults() -> int:  # page faults of 20 blocks of 4 MiB, each written, freed and made again (a step's activations)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        block = np.ones(4 << 20, dtype=np.uint8)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert return_freed_memory()
setting_up = faults()
assert keep_working_memory()
training = faults()
print(setting_up, training)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_training_worker_reuses_its_freed_blocks_and_a_set_up_gives_them_back() -> None:
    """Fails if every step's large blocks are mapped afresh (new zeroed pages each step: a third of a
    one-device worker's CPU went to page faults), or if set-up keeps what it frees."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert out.returncode == 0, out.stderr
    setting_up, training = map(int, out.stdout.split())
    assert setting_up >= 20 * 256  # each 4 MiB block mapped afresh: its pages faulted in each time
    assert training < setting_up / 5, (setting_up, training)
