"""Export a ``tf.compat.v1`` session's graph to ONNX (frozen, then tf2onnx), atomically."""

from __future__ import annotations

import os
from typing import Sequence

from recal_core.atomic import atomic_path

from ..utils import tf_compat


def frozen_graph_def(sess, outputs: Sequence[str], fed: Sequence[str] = ()):
    """The graph that computes ``outputs`` with every variable a constant and every ``PlaceholderWithDefault``
    not in ``fed`` its default (so a ``training`` switch left at False exports the inference path only)."""
    names = [o.split(":")[0] for o in outputs]
    graph_def = tf_compat.graph_util.convert_variables_to_constants(sess, sess.graph.as_graph_def(), names)
    fed_ops = {f.split(":")[0] for f in fed}
    for node in graph_def.node:
        if node.op == "PlaceholderWithDefault" and node.name not in fed_ops:
            node.op = "Identity"  # of its default, which is its first input
            node.attr["T"].CopyFrom(node.attr["dtype"])
            del node.attr["dtype"]
            del node.attr["shape"]
    return tf_compat.graph_util.extract_sub_graph(graph_def, names)


def export_onnx(sess: tf_compat.Session, path: str | os.PathLike, inputs: Sequence[str], outputs: Sequence[str], *,
                opset: int | None = None) -> str:
    """Write the session's graph from ``inputs`` to ``outputs`` (tensor names, ``"inputs:0"``) as ONNX to
    ``path``; nothing is written unless tf2onnx and the ONNX checker succeed. After a QAT recipe's
    ``complete_graph`` the result is a QDQ model for ``recal_onnx.quantize_qat_export``.

    Args:
        sess: the session holding the trained variables.
        path: the ONNX file to write (atomically).
        inputs: the graph's input tensor names, e.g. ``["inputs:0"]``.
        outputs: its output tensor names.
        opset: the ONNX opset (tf2onnx's default when None)."""
    return graph_def_to_onnx(frozen_graph_def(sess, outputs, inputs), path, inputs, outputs, opset=opset)


def graph_def_to_onnx(graph_def, path: str | os.PathLike, inputs: Sequence[str], outputs: Sequence[str], *,
                      opset: int | None = None) -> str:
    """:func:`export_onnx` of a graph already frozen by :func:`frozen_graph_def`."""
    import onnx

    try:
        import tf2onnx
    except ImportError as exc:
        raise ImportError("exporting TensorFlow to ONNX needs tf2onnx>=1.17: pip install 'recal[tf-cpu]'") from exc
    model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=list(inputs), output_names=list(outputs),
                                              opset=opset)
    with atomic_path(path) as tmp:
        tmp.write_bytes(model.SerializeToString())
        onnx.checker.check_model(str(tmp))
    return str(path)
