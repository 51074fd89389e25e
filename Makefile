# make test        create .venv, install the package with its dev extra, lint (ruff), run the whole test suite
# make test-fast   the same install, then the tests not marked slow (every module, about 1.5 minutes on 2 cores)
# make demo        create .venv, install, run the main job: train DIFF and the matched Transformer
#                  side by side on the embedded corpus and write out/compare/report.md
# make gpu-check   on a CUDA machine with torch, triton and transformers already installed (no .venv,
#                  no network): the CUDA tests and bench gpu, results in $(OUT) (BENCHMARKS.md)
PYTHON ?= python3
VENV ?= .venv
OUT ?= out/gpu-check
BIN := $(VENV)/bin

.PHONY: install test test-fast demo gpu-check clean

# constraints.txt: the exact versions CI uses (torch the local CPU wheel); pyproject.toml has ranges
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

demo: install
	$(BIN)/diff-transformer compare --out out/compare

gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh $(OUT)

clean:
	rm -rf $(VENV) out .pytest_cache
