# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast docs bench check-wheel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# torch==2.13.0 first: pip takes the local CPU wheel; an unpinned torch would pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[all,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=15

# the manual and API reference (mkdocs + mkdocstrings) into site/; strict: a warning fails the build
docs: $(STAMP)
	$(BIN)/python scripts/render_docs.py
	$(BIN)/python -m mkdocs build --strict --quiet

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto -m "not slow"

# every benchmark script, each printing its table (several minutes on 2 cores)
bench: $(STAMP)
	$(BIN)/python scripts/bench_torch_overhead.py --steps 60
	$(BIN)/python scripts/bench_tf_overhead.py
	$(BIN)/python scripts/bench_onnx.py --quick
	$(BIN)/python scripts/bench_accuracy.py
	$(BIN)/python scripts/bench_pruning.py
	$(BIN)/python scripts/bench_thinning.py
	$(BIN)/python scripts/bench_transformer_thinning.py --quick
	$(BIN)/python scripts/bench_keras.py
	$(BIN)/python scripts/bench_keras_backends.py

# the wheel installed with each extra into a fresh venv runs that extra's README quick start
check-wheel:
	PY=$(PY) scripts/check_wheel.sh

clean:
	rm -rf $(VENV) build site *.egg-info
