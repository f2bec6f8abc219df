import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# `tests.zoo:factory` model specs must import in this process and in CLI subprocesses
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("FUSIONLLM_ALLOW_IMPORTS", "tests.")
# calibrated op times go to a temporary directory of this test run, never to the user's cache
os.environ["FUSIONLLM_CACHE"] = tempfile.mkdtemp(prefix="fusionllm-test-cache-")
atexit.register(shutil.rmtree, os.environ["FUSIONLLM_CACHE"], True)

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
