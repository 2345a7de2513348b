"""Each planned layer's candidates timed in onnxruntime on this CPU (issue 71): every candidate gets a time from a
model a default session runs, a shape is timed once and cached, and what the cache holds is reused, not re-timed."""

import json
import warnings

import pytest

from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates
from recal_onnx import layer_latency, timed_candidates


def _layer(name, k, n, rows=1, bias=True):
    candidates = tuple(Candidate(b, 1.0, 0.0) for b in (FLOAT, 8, 4, 2))
    return LayerCandidates(name, k * n, candidates, k, n, rows, bias)


def test_every_candidate_is_timed_once_a_shape_and_the_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("RECAL_CACHE", str(tmp_path))
    calls = []
    real = layer_latency.time_candidates

    def counted(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_latency, "time_candidates", counted)
    layers = [_layer("a", 64, 128), _layer("b", 64, 128), _layer("c", 128, 64, rows=4, bias=False)]
    timed = timed_candidates(layers)
    assert sorted(calls) == [(1, 64, 128), (4, 128, 64)]  # a and b share a shape: timed once
    assert all(c.latency > 0 for layer in timed for c in layer.candidates)
    assert [c.latency for c in timed[0].candidates] == [c.latency for c in timed[1].candidates]
    assert (tmp_path / "layer_latency.json").is_file()
    calls.clear()
    again = timed_candidates(layers)
    assert calls == [] and again == timed  # read from the cache
    assert timed_candidates(layers, rows=2) and calls == [(2, 64, 128), (2, 128, 64)]  # another shape: timed


def test_a_cache_that_does_not_read_is_said_and_written_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("RECAL_CACHE", str(tmp_path))
    (tmp_path / "layer_latency.json").write_text("{not json")
    with pytest.warns(UserWarning, match="layer latency cache does not read"):
        timed_candidates([_layer("a", 32, 32)])
    assert json.loads((tmp_path / "layer_latency.json").read_text())


def test_shapes_the_converter_leaves_float_and_unmeasured_layers_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RECAL_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="MatMulNBits runs blocks of a power of two"):
        timed_candidates([_layer("a", 48, 32)], group_size=24)
    with pytest.raises(ValueError, match="no shape to time"):
        timed_candidates([LayerCandidates("a", 10, (Candidate(FLOAT, 40.0, 0.0),))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timed_candidates([_layer("a", 32, 32)], cache=False)
    assert not (tmp_path / "layer_latency.json").exists()
