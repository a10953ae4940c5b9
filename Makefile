# One command sets up and runs the demo; one sets up and runs the tests. Both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch for this machine; GPU users install the torch they need first (pyproject allows a range).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup lint test demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# ruff (pyflakes, isort, bugbear, pyupgrade, pycodestyle errors) and pyright (basic), both configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/pyright

test: lint
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/blockdraft demo

clean:
	rm -rf $(VENV) demo-work
