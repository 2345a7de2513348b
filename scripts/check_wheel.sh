#!/usr/bin/env bash
# Build recal's wheel and sdist, install the wheel with each extra into a fresh virtual environment, and run every
# README and docs example there, each from an empty folder with no link to the checkout (scripts/docs_examples.py
# says which environment an example needs): proof that `pip install recal[torch]` (and tf-cpu, onnx) works on its
# own. The tf-cpu environment takes the lowest TensorFlow the extra admits (2.20; .venv has 2.21).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fresh() {  # fresh NAME: a new venv with an up-to-date pip
    "$PY" -m venv "$work/$1"
    "$work/$1/bin/python" -m pip install --quiet --upgrade pip
}

# the sdist, then the wheel built from it (so the sdist is proven to hold everything the wheel needs)
fresh build
"$work/build/bin/pip" install --quiet build
"$work/build/bin/python" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1
wheel=$(ls "$work"/dist/recal-*.whl)
echo "built $(ls "$work/dist" | tr '\n' ' ')"
"$PY" scripts/docs_examples.py "$work/examples" > /dev/null
examples() {  # examples VENV KIND: every example for KIND, each in an empty folder of its own
    for file in "$work"/examples/*."$2".*; do
        name=$(basename "$file")
        folder="$work/run/${name%.*}"
        mkdir -p "$folder"
        start=$(date +%s)
        case "$file" in
            *.py) (cd "$folder" && "$work/$1/bin/python" "$file" > "$folder.log" 2>&1) ;;
            *.sh) (cd "$folder" && PATH="$work/$1/bin:$PATH" bash "$file" > "$folder.log" 2>&1) ;;
        esac || { tail -40 "$folder.log"; echo "FAILED: $name from an empty folder (recal[$1])"; exit 1; }
        echo "ok: $name runs from an empty folder with recal[$1] ($(( $(date +%s) - start )) s)"
    done
}

fresh torch
"$work/torch/bin/pip" install --quiet torch==2.13.0  # first: the local CPU wheel
"$work/torch/bin/pip" install --quiet "$wheel[torch,huggingface]"
examples torch torch
(mkdir "$work/run/demo" && cd "$work/run/demo" &&
 "$work/torch/bin/recal" demo --framework torch --no-progress --output demo > "$work/demo.log")
test -f "$work/run/demo/demo/torch-prune-quant/model.int8.onnx"
echo "ok: recal[torch] runs 'recal demo' (PyTorch) from the wheel"

fresh tf-cpu
"$work/tf-cpu/bin/pip" install --quiet "tensorflow-cpu==2.20.*" "$wheel[tf-cpu]"
examples tf-cpu tf

fresh onnx
"$work/onnx/bin/pip" install --quiet "$wheel[onnx]"
(cd "$work/run" && "$work/onnx/bin/recal" quantize-qat-export README-python-0.torch/model.onnx int8.onnx)
echo "ok: recal[onnx] converts the PyTorch quick start's QAT export"
