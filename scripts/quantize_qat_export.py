"""Convert a QAT ONNX export to a fully quantized int8 model (same as ``recal quantize-qat-export``).

    python scripts/quantize_qat_export.py IN.onnx OUT.onnx [--format qdq] [--no-verify]
"""

import sys

from recal_app import main

if __name__ == "__main__":
    sys.exit(main(["quantize-qat-export", *sys.argv[1:]]))
