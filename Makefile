# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-fast docs bench check-wheel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# torch==2.13.0 first: pip takes the local CPU wheel; an unpinned torch would pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[all,dev]"
	touch $(STAMP) $(DEMO_STAMP)

# the demo needs PyTorch, TensorFlow and onnxruntime only (a test set-up has them too)
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[torch,tf-cpu]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=15

# the manual and API reference (mkdocs + mkdocstrings) into site/; strict: a warning fails the build
docs: $(STAMP)
	$(BIN)/python scripts/render_docs.py
	$(BIN)/python -m mkdocs build --strict --quiet

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto -m "not slow"

# every benchmark, each at a small setting, printing its table (a check that each runs: ~25 min on 2 cores);
# the docs' figures come from each script's defaults with --json (docs/benchmarks.md)
BENCH_TMP := $(shell mktemp -u -d /tmp/recal-bench-XXXXXX)
bench: $(STAMP)
	$(BIN)/python scripts/speed.py --size 64 --rounds 3 --output $(BENCH_TMP)/speed
	$(BIN)/python scripts/bench_torch_overhead.py --steps 20
	$(BIN)/python scripts/bench_lsq_overhead.py --steps 3
	$(BIN)/python scripts/bench_export.py --rounds 1 --models resnet18
	$(BIN)/python scripts/bench_learned_scales.py --steps 5 --lrs 1e-3
	$(BIN)/python scripts/bench_plan.py --seeds 0 --hidden 64 --layers 1 --steps 20 --qat-steps 5 --calibration 1
	$(BIN)/python scripts/bench_plan_time.py --layers 1 --hidden 128
	$(BIN)/python scripts/bench_layer_latency.py
	$(BIN)/python scripts/bench_tf_overhead.py --steps 20
	$(BIN)/python scripts/bench_onnx.py --quick --repeat 5
	$(BIN)/python scripts/bench_accuracy.py --seeds 0
	$(BIN)/python scripts/bench_pruning.py --seeds 0
	$(BIN)/python scripts/bench_reduce_range.py --seeds 0
	$(BIN)/python scripts/bench_thinning.py --seeds 0 --size 64 --rounds 3
	$(BIN)/python scripts/bench_zoo.py --quick --models resnet18 hf-mobilenet-v2
	$(BIN)/python scripts/bench_interop.py --quick
	$(BIN)/python scripts/bench_transformers.py --quick --rounds 3 --models bert
	$(BIN)/python scripts/bench_transformer_thinning.py --quick
	$(BIN)/python scripts/bench_llm.py --steps 20 --qat-steps 10 --layers 1 --hidden 64 --rounds 3 --test-windows 16 --train-mb 0.5
	$(BIN)/python scripts/bench_keras.py --rounds 2 --steps 10 --seeds 1
	$(BIN)/python scripts/bench_keras_backends.py --rounds 2 --steps 5
	$(BIN)/python scripts/bench_keras_applications.py --models mobilenet_v3_small --steps 4
	$(BIN)/python scripts/bench_jax_compile.py --models MobileNetV2
	$(BIN)/python scripts/bench_hostile_inputs.py
	$(BIN)/python scripts/bench_large_decoder.py --hidden 256 --ffn 512 --layers 2 --vocab 4000

# the wheel installed with each extra into a fresh venv runs that extra's README quick start
check-wheel:
	PY=$(PY) scripts/check_wheel.sh

clean:
	rm -rf $(VENV) build site *.egg-info
