"""The core's channel-coupling rules on hand-written op lists (no framework)."""

import pytest

from recal_core.channel_coupling import CouplingError, Op, channel_spaces, pruning_groups


def _resnet_block():
    return [
        Op("x", "input", (), "x"),
        Op("stem", "layer", ("x",), "s", "stem.weight"),
        Op("bn", "norm", ("s",), "b", "bn.weight", "bn.bias", ("bn.running_mean",)),
        Op("relu", "same", ("b",), "r"),
        Op("conv1", "layer", ("r",), "c1", "conv1.weight"),
        Op("conv2", "layer", ("c1",), "c2", "conv2.weight", "conv2.bias"),
        Op("add", "add", ("c2", "r"), "a"),
        Op("dw", "depthwise", ("a",), "d", "dw.weight", "dw.bias"),
        Op("flat", "flatten", ("d",), "f"),
        Op("fc", "layer", ("f",), "y", "fc.weight"),
        Op("the model's output", "output", ("y",)),
    ]


def test_residual_add_merges_producers_and_followers_follow():
    spaces = channel_spaces(_resnet_block())
    stream = next(s for s in spaces if any(p.name == "stem" for p in s.producers))
    assert [p.name for p in stream.producers] == ["stem", "conv2"]
    assert [(op.name, ts) for op, ts in stream.followers] == [("bn", ("bn.bias", "bn.running_mean")),
                                                              ("dw", ("dw.weight", "dw.bias"))]
    assert [(c.name, w) for c, w in stream.consumers] == [("conv1", 1), ("fc", -1)]
    assert stream.thinnable
    assert not next(s for s in spaces if any(p.name == "fc" for p in s.producers)).thinnable  # the output


def test_groups_need_every_producer_with_the_same_modifier():
    spaces = channel_spaces(_resnet_block())
    [(space, kind, members)] = pruning_groups(spaces, {"stem": (1, "filter"), "conv2": (1, "filter")})
    assert kind == "filter" and members == ["stem", "conv2"]
    with pytest.raises(CouplingError, match="stem: mask_type filter: conv2 adds its output to stem"):
        pruning_groups(spaces, {"stem": (1, "filter")})
    with pytest.raises(CouplingError, match="conv2 adds its output"):
        pruning_groups(spaces, {"stem": (1, "filter"), "conv2": (2, "filter")})
    with pytest.raises(CouplingError, match="fc: mask_type filter: .* the model's output"):
        pruning_groups(spaces, {"fc": (1, "filter")})
    [(_, _, readers)] = pruning_groups(spaces, {"conv1": (1, "channel"), "fc": (1, "channel")})
    assert readers == ["conv1", "fc"]


def test_an_unknown_op_blocks_the_spaces_it_touches():
    ops = [Op("x", "input", (), "x"), Op("a", "layer", ("x",), "t", "a.weight"),
           Op("view", "other", ("t",), "v"), Op("b", "layer", ("v",), "y", "b.weight"),
           Op("out", "output", ("y",))]
    with pytest.raises(CouplingError, match="a: mask_type filter: its output channels \\(filters\\) also reach view"):
        pruning_groups(channel_spaces(ops), {"a": (0, "filter")})
