# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
DEMO_STEPS ?= 300

.PHONY: demo test test-fast test-soak test-two-torch lint install install-dev testbed-tools clean

# Reuse a torch the system Python already has (venv with system site-packages); otherwise pin 2.13.0,
# which on the development machines installs the CPU build that lies on disk.
$(VENV)/.created:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "reusing the installed torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q $(TORCH_PIN); \
	fi
	@touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

# The testbed's NAT sites need nftables (`nft`), the dashboard's browser tests Chromium: installed as root
# where apt-get is, never failing the build (those tests skip, saying what to install).
testbed-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v nft >/dev/null 2>&1; then \
		if apt-get install -y -qq nftables >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nftables >/dev/null 2>&1; }; \
		then echo "installed nftables (for the testbed's NAT sites)"; \
		else echo "could not install nftables (apt-get install nftables): the NAT testbed tests will skip"; fi; \
	fi
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then \
		if apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; \
		then echo "installed chromium (for the dashboard's browser tests)"; \
		else echo "could not install chromium (apt-get install chromium): the dashboard's browser tests will skip"; fi; \
	fi

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# A local cluster: a coordinator and three worker processes on loopback, one pipeline stage each.
demo: $(VENV)/.installed
	$(VENV)/bin/fusionllm train --cluster local:3 --model gpt-micro --steps $(DEMO_STEPS) --metrics runs/demo/metrics.jsonl --run-dir runs/demo

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests

# Three tiers (markers in pyproject.toml). `make test` (CI): every test but the soak tier, processes,
# testbed (as root) and browser included.
test: $(VENV)/.installed-dev testbed-tools
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -n 2 --dist loadgroup

# In-process tests only (no `slow`: no subprocesses, root, browser or long runs).
test-fast: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -m "not slow and not soak"

# A worker on the oldest torch pyproject.toml allows, in a pipeline of this torch: builds that environment once
# (~/.cache/fusionllm/torch-2.4.1, several GB from the package registry), then runs the test.
test-two-torch: $(VENV)/.installed-dev
	$(PY) -c "import sys; sys.path.insert(0, '.'); from experiments.two_torch import old_python; old_python('2.4.1')"
	$(PY) -m pytest -m two_torch

# The soak tier: real worker processes on small random clusters, against one process (a few minutes).
test-soak: $(VENV)/.installed-dev
	$(PY) -m pytest -m soak

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
