"""Op by op: the converted model's every integer tensor that the QAT model quantizes too, each computed from the
QAT model's own values of the integer tensors it reads, so that a difference is that op's own rounding and not what
it inherited; and each differing value explained as a value on a rounding boundary of the QAT model's own unrounded
value, or counted as unexplained (a misread weight, scale or sign)."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np
import onnx

from .output_diff import float_gap
from .qdq import signedness_shift
from .sessions import reference_session, session
from .verify_inputs import batched_inputs, fixed_batch

LOCAL_SAMPLES = 16  # the op-by-op check runs on the first samples
LOCAL_MAX_BYTES = 1_500_000_000  # above this a model is not copied for the op-by-op check (protobuf's 2 GB)
MEMORY = 256 * 2**20  # bytes of both models' outputs held at once in the end-to-end comparison
BOUNDARY = 1 / 32  # a value one step off is explained when the QAT model's own unrounded value lay this close
# (in steps) to the boundary between the two integers: float summation order, requantization in float32, a bias
# rounded onto its int32 grid (about 1/128 of a step) all move a value less; a misread weight, scale or sign more


def fixed_parts(feeds: dict[str, np.ndarray], fixed: int | None) -> list[dict[str, np.ndarray]] | None:
    """``feeds`` as one feed a batch where the model's ``fixed`` batch splits them into several, else None (one
    run takes them all)."""
    total = {np.shape(v)[0] if np.ndim(v) else -1 for v in feeds.values()}
    if not fixed or len(total) != 1 or (n := total.pop()) <= fixed or n % fixed:
        return None
    return [{k: v[s:s + fixed] for k, v in feeds.items()} for s in range(0, n, fixed)]


def _copyable(reference: onnx.ModelProto | str) -> onnx.ModelProto | None:
    """``reference`` as a model the checks beyond end to end may copy, or None above :data:`LOCAL_MAX_BYTES`."""
    size = os.path.getsize(reference) if isinstance(reference, str) else reference.ByteSize()
    if size > LOCAL_MAX_BYTES:
        return None
    return onnx.load(reference) if isinstance(reference, str) else reference


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    copy.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return copy


def op_by_op(reference: onnx.ModelProto | str, candidate: onnx.ModelProto, feeds: dict[str, np.ndarray],
             result, thinned: dict[str, np.ndarray], per_sample: int = 0,
             tied: dict[str, float] | None = None, moves: dict[str, float] | None = None):
    """``result`` (a :class:`recal_onnx.verify.Verification`) with the op-by-op comparison filled in (unchanged where
    a model is too large to copy).
    ``per_sample``: the bytes one sample's outputs took end to end; the op-by-op run takes as many samples as
    fit :data:`MEMORY` (at most :data:`LOCAL_SAMPLES`)."""
    reference = _copyable(reference)
    if reference is None or candidate.ByteSize() > LOCAL_MAX_BYTES:
        return result
    batched, fixed = batched_inputs(candidate), fixed_batch(candidate)
    local = int(max(1, min(LOCAL_SAMPLES, MEMORY // max(per_sample, 1))))
    if fixed:  # whole fixed batches, as many as make ``local`` samples (at least one)
        local = max(local // fixed, 1) * fixed
        feeds = {k: v[:local] for k, v in feeds.items()}
    else:
        feeds = {k: v[:local] if k in batched else v for k, v in feeds.items()}
    produced = {o for n in candidate.graph.node for o in n.output} - {o.name for o in candidate.graph.output}
    names = [n.output[0] for n in reference.graph.node if n.op_type == "QuantizeLinear" and n.output[0] in produced]
    if not names:  # no quantized activation both models compute (a weight-only model): end to end says it all
        return result
    outputs = len(candidate.graph.output)
    grids = _grids(reference, names)  # each quantizer's float input and its scale, zero point, axis
    unrounded = sorted({grid[0] for grid in grids.values()} - set(feeds))
    reference_run = reference_session(_with_outputs(reference, names + unrounded))
    probe = _with_outputs(candidate, names)  # its own values first (their types and shapes), then forced
    own_run, forced_run, given_names = session(probe), None, []
    steps, counts, compared, pairs = {}, {}, 0, []  # pairs: each run's float outputs, (candidate, QAT model)
    margins, unexplained = {}, {}  # per tensor: the differing values' largest distance from a boundary; how many far
    for part in fixed_parts(feeds, fixed) or [feeds]:  # one fixed batch a run, each with its own QAT integers
        ref_values = reference_run.run(None, part)
        ref_outputs, ref = ref_values[:outputs], dict(zip(names, ref_values[outputs:outputs + len(names)]))
        floats = {**part, **dict(zip(unrounded, ref_values[outputs + len(names):]))}
        for name, kept in thinned.items():
            if name in ref and ref[name].ndim > 1 and ref[name].shape[1] > kept.max(initial=-1):
                ref[name] = np.take(ref[name], kept, axis=1)
        own = dict(zip(names, own_run.run(None, part)[outputs:]))
        if forced_run is None:  # the tensors both models hold on one grid, and the probe that reads the QAT's
            given_names = [name for name in names if _on_grid(own[name], ref[name]) is not None]
            if not given_names:
                return result
            forced = _with_outputs(candidate, names)
            for node in forced.graph.node:
                for i, name in enumerate(node.input):
                    if name in given_names:
                        node.input[i] = name + "__qat"
            forced.graph.input.extend(onnx.helper.make_tensor_value_info(
                name + "__qat", onnx.helper.np_dtype_to_tensor_dtype(own[name].dtype), None) for name in given_names)
            forced_run = session(forced)
        on_grid = {name: _on_grid(own[name], ref[name]) for name in given_names}
        given = {name: value for name, value in on_grid.items() if value is not None}  # the rest: its own values
        got = forced_run.run(None, {**part, **{name + "__qat": given.get(name, own[name]) for name in given_names}})
        for name, value in zip(names, got[outputs:]):
            if name in given:
                diff = np.abs(value.astype(np.int32) - given[name].astype(np.int32))
                steps[name] = max(steps.get(name, 0), int(diff.max(initial=0)))
                if diff.any():
                    margin, count = _boundary_margin(grids.get(name), floats, value, given[name], ref[name],
                                                     thinned.get(name), BOUNDARY + (moves or {}).get(name, 0.0))
                    if margin > margins.get(name, -1.0):
                        margins[name] = margin
                    unexplained[name] = unexplained.get(name, 0) + count
                apart = int((tied or {}).get(name, 0.0) * diff.size)  # exact ties, at most as many as can be
                counts[name] = counts.get(name, 0) + max(int(np.count_nonzero(diff)) - apart, 0)
                compared += diff.size
        pairs.append([(g, r) for g, r in zip(got, ref_outputs) if np.issubdtype(r.dtype, np.floating) and r.size])
    floats = [float_gap(np.concatenate([run[i][0].reshape(-1) for run in pairs]),
                        np.concatenate([run[i][1].reshape(-1) for run in pairs])) for i in range(len(pairs[0]))]
    where = max(steps, key=steps.get)
    far = max(margins, key=margins.get) if margins else ""
    return replace(result, local_steps=steps[where], local_tensor=where, local_float=max(floats) if floats else None,
                   local_tensors=len(given_names), local_share=sum(counts.values()) / max(compared, 1),
                   local_share_tensor=max(counts, key=counts.get),
                   local_tied=len(set(tied or {}) & set(given_names)),
                   local_unexplained=sum(unexplained.values()), local_margin=margins[far] if margins else None,
                   local_margin_tensor=far)


def _grids(model: onnx.ModelProto, names: list[str]) -> dict[str, tuple[str, np.ndarray, np.ndarray, int | None]]:
    """Per QuantizeLinear output in ``names`` whose scale and zero point are constants: ``(its float input, scale,
    zero point, axis)``, what its unrounded value ``x / scale + zero_point`` is computed from."""
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            constants[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    wanted, grids = set(names), {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.output[0] not in wanted or node.input[1] not in constants:
            continue
        zero = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        if zero is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1) if constants[node.input[1]].size > 1 else None
        grids[node.output[0]] = (node.input[0], constants[node.input[1]], zero, axis)
    return grids


def _boundary_margin(grid, floats: dict[str, np.ndarray], got: np.ndarray, given: np.ndarray, qat: np.ndarray,
                     kept: np.ndarray | None, allowed: float = BOUNDARY) -> tuple[float, int]:
    """For the values where the candidate's integers ``got`` differ from the QAT model's (``given``, on the
    candidate's grid; ``qat`` as the QAT model holds them, its channels the ``kept`` ones where the candidate thinned
    this tensor): the largest distance, in steps, of the QAT model's own unrounded value from the boundary between
    the two integers, and how many lie beyond ``allowed``. A value two or more steps off, or one whose unrounded
    value is unknown, counts as beyond (inf)."""
    differ = got != given
    gap = np.abs(got.astype(np.int32) - given.astype(np.int32))
    if grid is None or grid[0] not in floats:
        return math.inf, int(np.count_nonzero(differ))
    x, scale, zero, axis = grid
    x = floats[x]
    if axis is not None and x.ndim:
        shape = [1] * x.ndim
        shape[axis % x.ndim] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    exact = x.astype(np.float64) / scale.astype(np.float64) + zero.astype(np.float64)
    if exact.shape != qat.shape and kept is not None and exact.ndim > 1:  # thinned: this tensor's kept channels
        exact = np.take(exact, kept, axis=1)
    if exact.shape != got.shape:
        return math.inf, int(np.count_nonzero(differ))
    shift = given.astype(np.float64) - qat.astype(np.float64)  # the candidate's grid (uint8 for int8: +128)
    boundary = (got.astype(np.float64) + given.astype(np.float64)) / 2 - shift
    margin = np.where(gap > 1, np.inf, np.abs(exact - boundary))[differ]
    return float(margin.max(initial=0.0)), int(np.count_nonzero(margin > allowed))


def _on_grid(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray | None:
    """The QAT model's integers ``theirs`` on the candidate's grid, typed as ``mine`` (int8 activations that became
    uint8: +128); None where ``mine`` is no 8-bit tensor or the values leave its type (another grid)."""
    if mine.dtype not in (np.uint8, np.int8) or mine.shape != theirs.shape:
        return None
    # (a 0-d tensor stays an array, as onnxruntime takes)
    value = np.asarray(theirs.astype(np.int16) + signedness_shift(theirs.dtype, mine.dtype))
    if value.size and (value.min() < np.iinfo(mine.dtype).min or value.max() > np.iinfo(mine.dtype).max):
        return None
    return np.asarray(value.astype(mine.dtype))


