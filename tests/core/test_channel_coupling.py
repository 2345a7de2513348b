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
    [(space, kind, members)] = pruning_groups(spaces, {"stem.weight": (1, "filter"), "conv2.weight": (1, "filter")})
    assert kind == "filter" and [m.name for m in members] == ["stem", "conv2"]
    with pytest.raises(CouplingError, match="stem: mask_type filter: conv2 adds its output to stem"):
        pruning_groups(spaces, {"stem.weight": (1, "filter")})
    with pytest.raises(CouplingError, match="conv2 adds its output") as err:
        pruning_groups(spaces, {"stem.weight": (1, "filter"), "conv2.weight": (2, "filter")})
    assert err.value.modifier == 1
    with pytest.raises(CouplingError, match="fc: mask_type filter: .* the model's output"):
        pruning_groups(spaces, {"fc.weight": (1, "filter")})
    [(_, _, readers)] = pruning_groups(spaces, {"conv1.weight": (1, "channel"), "fc.weight": (1, "channel")})
    assert [r.name for r in readers] == ["conv1", "fc"]


def test_an_unknown_op_blocks_the_spaces_it_touches():
    ops = [Op("x", "input", (), "x"), Op("a", "layer", ("x",), "t", "a.weight"),
           Op("view", "other", ("t",), "v"), Op("b", "layer", ("v",), "y", "b.weight"),
           Op("out", "output", ("y",))]
    with pytest.raises(CouplingError, match="a: mask_type filter: its output channels \\(filters\\) also reach view"):
        pruning_groups(channel_spaces(ops), {"a.weight": (0, "filter")})


def test_live_channels_keeps_what_is_neither_zero_nor_unread():
    import numpy as np

    from recal_core.channel_coupling import input_columns, live_channels

    spaces = channel_spaces(_resnet_block())
    stream = next(s for s in spaces if any(p.name == "stem" for p in s.producers))
    values = {"stem.weight": np.ones((4, 3)), "conv2.weight": np.ones((4, 4)), "conv2.bias": np.ones(4),
              "bn.bias": np.ones(4), "bn.running_mean": np.ones(4), "dw.weight": np.ones((4, 1)),
              "dw.bias": np.ones(4), "conv1.weight": np.ones((4, 4)), "fc.weight": np.ones((2, 8))}
    for name in ("stem.weight", "conv2.weight", "conv2.bias", "bn.bias", "bn.running_mean", "dw.weight", "dw.bias"):
        values[name][1] = 0  # channel 1: exactly zero all along the way
    values["conv1.weight"][:, 3] = 0
    values["fc.weight"][:, 6:8] = 0  # channel 3: no consumer reads it (fc reads 2 features per channel)
    keep = live_channels(stream, lambda n: values[n] == 0)
    assert keep.tolist() == [True, False, True, False]
    values["bn.running_mean"][1] = 0.5  # a BatchNorm would turn the zero into a constant: not dead
    assert live_channels(stream, lambda n: values[n] == 0).tolist() == [True, True, True, False]
    assert input_columns(np.array([0, 2]), 4, 8).tolist() == [0, 1, 4, 5]
