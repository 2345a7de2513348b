#!/usr/bin/env bash
# Build recal's wheel, install it with each extra into a fresh virtual environment, and run that
# extra's README quick start there: proof that `pip install recal[torch]` (and tf-cpu, onnx) works on
# its own. The tf-cpu environment takes the lowest TensorFlow the extra admits (2.20; .venv has 2.21).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip wheel --no-deps --quiet --wheel-dir "$work/dist" .
wheel=$(ls "$work"/dist/recal-*.whl)
echo "built $(basename "$wheel")"
mkdir -p "$work/run"  # an empty folder: the examples name bundled recipes (recal:NAME), no checkout

fresh() {  # fresh NAME: a new venv with an up-to-date pip
    "$PY" -m venv "$work/$1"
    "$work/$1/bin/python" -m pip install --quiet --upgrade pip
}
quickstart() {  # quickstart VENV HEADING: run the README's block under HEADING in the scratch folder
    "$PY" scripts/readme_example.py "$2" > "$work/quickstart_$1.py"
    (cd "$work/run" && "$work/$1/bin/python" "$work/quickstart_$1.py")
    echo "ok: recal[$1] runs the README's '$2'"
}

fresh torch
"$work/torch/bin/pip" install --quiet torch==2.13.0  # first: the local CPU wheel
"$work/torch/bin/pip" install --quiet "$wheel[torch]"
quickstart torch "Quick start: PyTorch"
cp "$work/run/model.onnx" "$work/qat.onnx"
(cd "$work/run" && "$work/torch/bin/recal" demo --framework torch --no-progress --output demo > "$work/demo.log")
test -f "$work/run/demo/torch-prune-quant/model.int8.onnx"
echo "ok: recal[torch] runs 'recal demo' (PyTorch) from the wheel"

fresh tf-cpu
"$work/tf-cpu/bin/pip" install --quiet "tensorflow-cpu==2.20.*" "$wheel[tf-cpu]"
quickstart tf-cpu "Quick start: TensorFlow"
quickstart tf-cpu "Quick start: Keras 3"

fresh onnx
"$work/onnx/bin/pip" install --quiet "$wheel[onnx]"
(cd "$work/run" && "$work/onnx/bin/recal" quantize-qat-export "$work/qat.onnx" "$work/int8.onnx")
echo "ok: recal[onnx] converts the PyTorch quick start's QAT export"
