"""``drop_exporter_metadata`` on tiny graphs: what it drops and what it keeps."""


import onnx

from recal_onnx.ir_edits import Graph
from tests.support.onnx_graphs import Builder


def test_drop_exporter_metadata_keeps_other_keys():
    """The torch exporter's per-node record goes (its bytes counted); a user's own node metadata stays."""
    from recal_onnx.passes.drop_exporter_metadata import drop_exporter_metadata

    b = Builder()
    y = b.node("Relu", ["x"])
    model = b.model([("x", [2, 3])], [y])
    onnx.helper.set_metadata_props(model.graph.node[0], {"namespace": "m: M/relu: aten.relu",
                                                         "pkg.torch.onnx.stack_trace": 'File "/home/me/m.py"',
                                                         "owner": "team-a"})
    g = Graph(model)
    assert drop_exporter_metadata(g) == len("namespace") + len("m: M/relu: aten.relu") + len(
        "pkg.torch.onnx.stack_trace") + len('File "/home/me/m.py"')
    kept = g.commit().graph.node[0].metadata_props
    assert {p.key: p.value for p in kept} == {"owner": "team-a"}
