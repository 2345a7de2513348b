"""The benchmarks' harness (``scripts/bench/``): interleaved timing, one run per CPU in a results file, the
layout table drawn from the tree."""

import json

import numpy as np
import onnx
from onnx import TensorProto, helper


from bench import results, timing
from code_layout import layout_table


def test_interleaved_rotates_the_first_variant_and_counts_each_sample():
    calls = []
    times = timing.interleaved({name: (lambda name=name: calls.append(name)) for name in "abc"}, rounds=3,
                               per_round=2, warmup=1, repeat={"b": 3})
    assert calls[:3] == ["a", "b", "c"]  # the warm-up, once each
    timed = calls[3:]
    assert timed[:2] == ["a", "a"] and timed[2:8] == ["b"] * 6  # b: 2 samples of 3 calls each
    starts = [timed[0], timed[10], timed[20]]
    assert starts == ["a", "b", "c"]  # each round starts one variant later
    assert {k: len(v) for k, v in times.items()} == {"a": 6, "b": 6, "c": 6}
    assert timing.medians({"x": [1.0, 3.0, 2.0]}, 1e3) == {"x": 2000.0}


def _relu(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_interleaved_latency_times_onnx_models(tmp_path, monkeypatch):
    path = _relu(tmp_path)
    ms = timing.interleaved_latency({"a": path, "b": path}, {"x": np.ones((1, 4), np.float32)}, rounds=2)
    assert set(ms) == {"a", "b"} and all(0 < v < 1e3 for v in ms.values())
    import recal_onnx

    made, real = [], recal_onnx.session
    monkeypatch.setattr(recal_onnx, "session", lambda p, t: made.append(p) or real(p, t))
    ms = timing.interleaved_latency({"a": path, "b": path}, {"x": np.ones((1, 4), np.float32)}, rounds=2, sessions=3)
    assert set(ms) == {"a", "b"} and len(made) == 6  # three sessions of each, their samples pooled


def test_groups_take_turns_each_round_in_fresh_sessions(tmp_path, monkeypatch):
    import recal_onnx

    path = _relu(tmp_path)
    made, real = [], recal_onnx.session
    monkeypatch.setattr(recal_onnx, "session", lambda p, t: made.append(p) or real(p, t))
    feed = {"x": np.ones((1, 4), np.float32)}
    ms = timing.in_turns({"m1": ({"a": path, "b": path}, feed), "m2": ({"c": path}, feed)}, rounds=3, per_round=2)
    assert {g: set(v) for g, v in ms.items()} == {"m1": {"a", "b"}, "m2": {"c"}}
    assert len(made) == 3 * 3 and all(0 < v < 1e3 for v in ms["m1"].values())  # every file, every round, anew


def test_a_run_replaces_only_the_run_of_its_own_cpu(tmp_path):
    path = tmp_path / "r.json"
    results.save_run(path, {"cpu": "AVX2", "rows": [1]})
    results.save_run(path, {"cpu": "VNNI", "rows": [2]})
    results.save_run(path, {"cpu": "AVX2", "rows": [3]})
    assert json.loads(path.read_text()) == {"runs": [{"cpu": "VNNI", "rows": [2]}, {"cpu": "AVX2", "rows": [3]}]}
    assert results.load(path) == json.loads(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # written whole: no temporary left beside it
    assert "runs" in results.load("transformers.json")  # a bare name: docs/results/


def test_every_run_says_which_cpu_measured_it():
    label = results.machine()
    assert label["cpu"].startswith("CPU: ") and label["onnxruntime"]


def test_the_layout_table_lists_every_package_and_what_it_imports():
    table = layout_table()
    for package in ("recal_torch.qat", "recal_torch.pruning", "recal_torch.tracing", "recal_torch.export",
                    "recal_torch.training", "recal_keras", "recal_onnx.passes"):
        assert f"| `{package}` |" in table
    qat = next(line for line in table.splitlines() if line.startswith("| `recal_torch.qat` |"))
    assert "`plan`" in qat and "`recal_core`" in qat and "`recal_torch.export`" not in qat
