"""A packaged install: the wheel, installed (not editable) in a fresh environment, is a working fusionllm.

Why this can fail: a module or data file the package needs but the wheel leaves out (the dashboard's
page, the ``py.typed`` marker), an entry point that names the wrong function, or code that reads files
of the source checkout works from the repository and breaks for everyone who installs it.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import fusionllm

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], timeout: float = 300, **kw: object) -> subprocess.CompletedProcess:
    # never a source tree of fusionllm on PYTHONPATH (a run as `PYTHONPATH=src pytest`): the installed wheel must be what imports
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "fusionllm").is_dir()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}: {done.stdout[-1500:]} {done.stderr[-1500:]}"
    return done


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_environment_runs(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # a copy, so that building leaves nothing in the checkout
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", tree])
    wheel = next((tmp_path / "dist").glob("fusionllm-*.whl"))

    env = tmp_path / "env"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", env])
    py, bin_dir = env / "bin" / "python", env / "bin"
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel])
    # the dependencies (torch, numpy, ...) from this environment, after the fresh one's own packages:
    # a directory named in a .pth file is searched, its own .pth files (the editable install's) are not
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    where = _run([py, "-c", "import fusionllm; print(fusionllm.__file__)"], cwd=tmp_path).stdout.strip()
    assert Path(where).is_relative_to(env), f"fusionllm imported from {where}, not from the installed wheel"
    assert _run([bin_dir / "fusionllm", "--version"], cwd=tmp_path).stdout.strip() == f"fusionllm {fusionllm.__version__}"
    models = _run([py, "-m", "fusionllm", "models"], cwd=tmp_path).stdout
    assert "gpt-micro" in models and "gpt2-xl" in models
    package = Path(where).parent
    assert (package / "control" / "web" / "index.html").is_file() and (package / "py.typed").is_file()

    # the goal: from the install to a distributed run started from a Python script, nothing else
    script = tmp_path / "train.py"
    script.write_text("import fusionllm\n"
                      "run = fusionllm.train(model='gpt-nano', cluster='local:2', steps=2, batch_size=4, seq_len=32, micro_batches=2,"
                      " eval_every=2, run_dir='run')\n"
                      "print('val_loss', run.val_loss, len(run.plan['stages']))\n")
    out = _run([py, script], cwd=tmp_path, timeout=600).stdout
    assert "val_loss" in out and out.strip().endswith(" 2"), out[-1500:]
