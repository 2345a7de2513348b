"""Convert a QAT ONNX export to a fully quantized int8 model (same as ``recal quantize-qat-export``).

    python scripts/quantize_qat_export.py IN.onnx OUT.onnx [--format qdq] [--no-verify]
"""

import argparse
import sys

from recal_onnx.cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except (ValueError, OSError) as exc:
        print(f"quantize_qat_export: {exc}", file=sys.stderr)
        sys.exit(2)
