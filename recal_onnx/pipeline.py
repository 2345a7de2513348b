"""The converter's pipeline, declared in one place: which passes run, in what order, on what condition, with what.

Each :class:`Step` names its passes and what they need from the conversion's :class:`Options` (the format, the
target's weight storage, thinning); a pass whose signature takes ``findings`` reads or adds to the conversion's
:class:`~recal_onnx.findings.Findings`.
:func:`run_pipeline` runs the steps in order, each an onnx_ir ``PassManager`` of its passes
(:mod:`recal_onnx.conversion_pass`), and returns every pass's rewrite count; a repeated step runs its
passes in turn until none rewrites (a QLinear op made by one pass is what the next one matches).

0. :data:`READERS`, on the input (:func:`read_input`, before shape inference): ``encodings_to_qdq`` (a float model
   and AIMET's encodings, ``QuantizationSimModel.export``: the QDQ model they mean), ``qonnx_to_qcdq`` (QONNX's
   ``Quant``, Brevitas's ``export_qonnx``: the QuantizeLinear / Clip / DequantizeLinear it defines). Verification runs
   the model so read as the input, since onnxruntime cannot run the file as it is meant;
1. constants and folds: ``remove_dead_nodes`` (what no output reads), ``constants_to_initializers``,
   ``inputs_to_constants`` (initializers a file also lists as graph inputs: constants only, as the converter reads
   them),
   ``float16_to_float32`` (a model computing in float16, ModelOpt's ONNX default: float32), ``widen_weights``
   (4-bit weights as the int8 they hold; blocked MatMul weights as grouped rows), ``standard_qdq`` (onnxruntime's
   ``com.microsoft`` Q/DQ as the default domain's), ``remove_identities``, ``merge_twin_qdq`` (a Q/DQ pair per reader,
   onnxruntime's ``DedicatedQDQPair``: one for all), ``fold_constants`` (weights' Q becomes
   int8; ``widen_weights`` again for a float weight's Q to 4 bits, as AIMET writes it), ``fold_int32_biases`` (a
   ``DequantizeLinear(int32)`` bias: the float it means), ``weights_to_int8``
   (a weight with a zero point: symmetric int8 where its values fit), ``minmax_to_clip`` (jax2onnx's ``Max`` /
   ``Min`` by a constant: the Clip it is), ``average_pool_windows`` (an AveragePool whose window passes its input:
   what onnxruntime's integer kernel then means too), ``fold_weight_reshapes`` and ``fold_weight_transposes``
   (``DQ(w) -> Reshape / Transpose`` becomes ``DQ(reshaped / transposed w)``), ``fold_pads_into_convs``,
   ``weights_from_grids`` (a float weight on an int8 grid, its quantization folded into floats by tf2onnx: the
   DequantizeLinear of those integers), ``gather_int4_tables``, ``gather_int8_tables``, ``fold_conv_affine``
   (Div / Mul / Add / BatchNormalization after a conv into its weight and bias), ``zero_channel_scales``,
   ``finer_weight_grids`` (a layer whose float bias falls between its int32 steps, its weights within +-32: the same
   weights on a finer grid, its bias rounded on it);
2. ``thin_heads``, ``thin_channels`` (with ``thin``): the attention heads head pruning left dead; the channels (and
   FFN neurons) filter pruning left dead, in blocks of ``channel_block``;
3. ``scalar_activation_qparams``, ``activations_to_uint8``, ``remove_redundant_qdq``, ``remove_noop_clamps``;
4. format ``qoperator``: ``int8_passthrough``, ``affine_to_batchnorm``, ``batchnorm_to_conv``,
``conv_to_qlinearconv``, ``gemm_to_qgemm``, ``binary_to_qlinear``,
   ``sigmoid_to_qlinear``, ``softmax_to_qlinear``, ``concat_to_qlinear``, ``pool_to_qlinear``, ``unary_to_table`` (any
   other function of one quantized tensor: a 256-entry table), ``remove_redundant_qdq``, repeated;
   format ``qdq``: ``affine_to_batchnorm``, ``batchnorm_to_conv``, ``bias_to_int32``, ``fusible_qdq_pools``,
   ``softmax_to_qlinear`` (a softmax onnxruntime would fuse into its kernel on another grid stays float);
5. ``masks_to_exact_zeros``: a float softmax's mask of -100 (Swin's) becomes -10000, its probabilities exactly 0
   rather than denormals (slow on Intel CPUs); ``matmul_to_nbits``: weight-only layers (float input, grouped or
   per-channel 4/8-bit weights) to ``MatMulNBits``;
   ``shapes_from_integers``: a Shape of a dequantized tensor reads its integers (the dequantization, made only to be
   measured, goes);
6. ``uint8_weights`` when the target stores weights beyond +-64 as uint8;
7. ``bias_apart`` (a layer whose bias int32 cannot hold stays float, its bias in an Add of its own),
   ``dequantize_misaligned_weights`` (a float layer's weight dequantized along other than its output channels is
   written as its float values, which onnxruntime's fusions then leave alone), ``shield_float_weights`` (a float
   layer reading a quantized input reads it through a dequantization of its own, so that onnxruntime does not
   quantize its float weight itself).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import onnx

from .aimet_encodings import Encoding, load_encodings
from .conversion_pass import ConversionPass, run_passes, takes
from .findings import Findings
from .ir_edits import Graph
from .errors import ModelError
from .input_checks import is_qonnx_quantizer
from .reading_judge import judge_aimet_reading, judge_qonnx_reading
from .passes.activations_to_uint8 import activations_to_uint8
from .passes.bias_apart import bias_apart
from .passes.bias_to_int32 import bias_to_int32
from .passes.binary_to_qlinear import binary_to_qlinear
from .passes.concat_to_qlinear import concat_to_qlinear
from .passes.constants_to_initializers import constants_to_initializers
from .passes.fold_constants import fold_constants
from .passes.inputs_to_constants import inputs_to_constants
from .passes.remove_dead_nodes import remove_dead_nodes
from .passes.remove_identities import remove_identities
from .passes.scalar_activation_qparams import scalar_activation_qparams
from .passes.conv_to_qlinearconv import conv_to_qlinearconv
from .passes.affine_to_batchnorm import affine_to_batchnorm
from .passes.average_pool_windows import average_pool_windows
from .passes.batchnorm_to_conv import batchnorm_to_conv
from .passes.encodings_to_qdq import encodings_to_qdq
from .passes.fold_conv_affine import fold_conv_affine
from .passes.finer_weight_grids import finer_weight_grids
from .passes.float16_to_float32 import float16_to_float32
from .passes.weights_from_grids import weights_from_grids
from .passes.shield_float_weights import shield_float_weights
from .passes.fusible_qdq_pools import fusible_qdq_pools
from .passes.gather_int4_tables import gather_int4_tables
from .passes.gather_int8_tables import gather_int8_tables
from .passes.gemm_to_qgemm import gemm_to_qgemm
from .passes.fold_int32_biases import fold_int32_biases
from .passes.drop_exporter_metadata import drop_exporter_metadata
from .passes.int8_passthrough import int8_passthrough
from .passes.matmul_to_nbits import matmul_to_nbits
from .passes.dequantize_misaligned_weights import dequantize_misaligned_weights
from .passes.minmax_to_clip import minmax_to_clip
from .passes.remove_noop_clamps import remove_noop_clamps
from .passes.fold_pads_into_convs import fold_pads_into_convs
from .passes.per_channel_domain import per_channel_domain
from .passes.pool_to_qlinear import pool_to_qlinear
from .passes.qonnx_to_qcdq import qonnx_to_qcdq
from .passes.remove_redundant_qdq import remove_redundant_qdq
from .passes.shapes_from_integers import shapes_from_integers
from .passes.sigmoid_to_qlinear import sigmoid_to_qlinear
from .passes.standard_qdq import standard_qdq
from .passes.masks_to_exact_zeros import masks_to_exact_zeros
from .passes.softmax_to_qlinear import softmax_to_qlinear
from .passes.thin_channels import CHANNEL_BLOCK, thin_channels
from .passes.thin_heads import thin_heads
from .passes.merge_twin_qdq import merge_twin_qdq
from .passes.uint8_weights import uint8_weights
from .passes.unary_to_table import unary_to_table
from .passes.fold_weight_reshapes import fold_weight_reshapes
from .passes.fold_weight_transposes import fold_weight_transposes
from .passes.weights_to_int8 import weights_to_int8
from .passes.widen_weights import widen_weights
from .passes.zero_channel_scales import zero_channel_scales

Pass = Callable[..., int]  # a rewrite: (graph, *args[, findings]) -> how many rewrites


@dataclass(frozen=True)
class Options:
    """What a conversion asks of the pipeline."""

    format: str = "qoperator"  # "qoperator" | "qdq"
    weight_type: str = "int8"  # "uint8": weights beyond +-64 stored as uint8 (the target's choice)
    thin: bool = True
    channel_block: int = CHANNEL_BLOCK
    accuracy_level: int = 0  # MatMulNBits: 0 float arithmetic (exact), 4 int8 inputs per block (faster, inexact)
    keep_exporter_metadata: bool = False  # the torch exporter's per-node record (module paths, stack traces)


@dataclass(frozen=True)
class Step:
    """Passes run together: only ``when`` the options say so, each given ``args(options)`` after the graph;
    ``repeat``: in turn until none rewrites."""

    passes: tuple[Pass, ...]
    when: Callable[[Options], bool] = lambda options: True
    args: Callable[[Options], tuple] = lambda options: ()
    repeat: bool = False


# what turns a file onnxruntime cannot run into the QDQ model it means: run on the input by read_input
READERS: tuple[Pass, ...] = (encodings_to_qdq, qonnx_to_qcdq)

PIPELINE: tuple[Step, ...] = (
    Step((remove_dead_nodes, constants_to_initializers, inputs_to_constants, float16_to_float32, widen_weights,
          standard_qdq, remove_identities, merge_twin_qdq, fold_constants, widen_weights, fold_int32_biases,
          weights_to_int8, minmax_to_clip, average_pool_windows, fold_weight_reshapes, fold_weight_transposes,
          fold_pads_into_convs, weights_from_grids, gather_int4_tables, gather_int8_tables, fold_conv_affine,
          batchnorm_to_conv, zero_channel_scales, finer_weight_grids)),
    Step((thin_heads,), when=lambda o: o.thin),
    Step((thin_channels,), when=lambda o: o.thin, args=lambda o: (o.channel_block,)),
    Step((scalar_activation_qparams, activations_to_uint8, remove_redundant_qdq, remove_noop_clamps)),
    Step((int8_passthrough, affine_to_batchnorm, batchnorm_to_conv, conv_to_qlinearconv, gemm_to_qgemm,
          binary_to_qlinear, sigmoid_to_qlinear, softmax_to_qlinear, concat_to_qlinear, pool_to_qlinear, unary_to_table,
          remove_redundant_qdq), when=lambda o: o.format == "qoperator", repeat=True),
    Step((int8_passthrough,), when=lambda o: o.format == "qdq", args=lambda o: (False,)),
    Step((affine_to_batchnorm, batchnorm_to_conv, bias_to_int32, fusible_qdq_pools), when=lambda o: o.format == "qdq"),
    Step((softmax_to_qlinear,), when=lambda o: o.format == "qdq", args=lambda o: (False,)),
    Step((masks_to_exact_zeros,)),
    Step((matmul_to_nbits,), args=lambda o: (o.accuracy_level,)),
    Step((shapes_from_integers,)),
    Step((uint8_weights,), when=lambda o: o.weight_type == "uint8"),
    Step((bias_apart, dequantize_misaligned_weights, shield_float_weights)),
    Step((drop_exporter_metadata,), when=lambda o: not o.keep_exporter_metadata),
    Step((per_channel_domain,)),  # last: what the passes made per channel, at the model's opset
)


def run_pipeline(g: Graph, options: Options, findings: Findings) -> dict[str, int]:
    """Run :data:`PIPELINE` on ``g``, each step an onnx_ir ``PassManager`` of its passes
    (:mod:`recal_onnx.conversion_pass`); return each pass's rewrites (by name, summed over repeats and steps).

    Args:
        g: the graph being converted (changed in place).
        options: the conversion's options.
        findings: the record the passes add to.
    """
    rewrites: dict[str, int] = {}
    for step in PIPELINE:
        if not step.when(options):
            continue
        passes = [ConversionPass(rewrite, g, findings, step.args(options)) for rewrite in step.passes]
        run_passes(passes, repeat=step.repeat)
        for done in passes:
            rewrites[done.name] = rewrites.get(done.name, 0) + done.rewrites
    return rewrites


def read_as_qdq(model: onnx.ModelProto | str | os.PathLike,
                encodings: str | os.PathLike | None = None) -> onnx.ModelProto:
    """The QDQ model a file onnxruntime cannot run as it is meant stands for: a QONNX model (Brevitas's
    ``export_qonnx``), or a float model with AIMET's ``.encodings``; any other model as it is. What the converter
    converts and verification runs as the input.

    Args:
        model: the model, or its path.
        encodings: the path of AIMET's encodings for a float ``model``.
    """
    name = str(model) if isinstance(model, (str, os.PathLike)) else "the model"
    proto = onnx.load(str(model)) if isinstance(model, (str, os.PathLike)) else model
    _, read, _ = read_input(proto, proto, name, load_encodings(encodings) if encodings is not None else None)
    return read


def read_input(model: onnx.ModelProto, reference, name: str, encodings: list[Encoding] | None = None,
               inputs: dict | None = None, shapes: dict | None = None):
    """``(model, reference, notes)``: the model the pipeline converts, the one verification runs as the input, and
    what :data:`READERS` did. Where none applies, ``model`` and ``reference`` as given; where one does (QONNX, or a
    float model with AIMET's ``encodings``), the QDQ model it reads, for both (onnxruntime cannot run the file as it
    means it). What they cannot read is refused, named, as a defect of the model called ``name``; the reading is
    judged on ``inputs`` (generated with ``shapes`` where None) against the format's own definition, QONNX's or
    AIMET's simulation (:mod:`recal_onnx.reading_judge`)."""
    qonnx = any(is_qonnx_quantizer(n.op_type, n.domain) for n in model.graph.node)
    if not qonnx and encodings is None:
        return model, reference, []
    original = model
    g = Graph(onnx.shape_inference.infer_shapes(model))  # an activation's rank, for one quantized per channel
    constants_to_initializers(g)
    findings = Findings()
    readers = [ConversionPass(reader, g, findings,
                              keywords={"encodings": encodings} if takes(reader, "encodings") else {})
               for reader in READERS]  # each reads what is its own and leaves the rest
    try:
        run_passes(readers)
    except ModelError as exc:
        raise ModelError(f"{name}: {exc}") from None
    read = g.commit()
    # a second judge: the format's own definition on the original file, tensor by tensor
    unjudged = (judge_qonnx_reading(original, read, name, inputs, shapes) if qonnx else
                judge_aimet_reading(original, read, encodings, name, inputs, shapes))
    findings.notes.extend([unjudged] if unjudged else [])
    model = onnx.ModelProto()
    model.CopyFrom(read)  # the pipeline's own: verification keeps ``read`` as it is
    return model, read, findings.notes
