"""Graph rewrite passes; each takes a :class:`~recal_onnx.ir_edits.Graph` (an ``onnx_ir`` model) and returns how many
rewrites it made.

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_onnx`'s.
"""

# The pipeline (recal_onnx.pipeline) names each pass module, in its declared order. What the rest of recal_onnx
# reads from a pass (the channel block thinning keeps, the block MatMulNBits runs a weight in, the uint8 weight
# form and its CPU check, whether a float weight lies on an int8 grid) it imports from here.
from .float16_to_float32 import float32_reference
from .weights_from_grids import on_a_grid
from .int8_passthrough import OPSET_12
from .matmul_to_nbits import nbits_block
from .thin_channels import CHANNEL_BLOCK
from .uint8_weights import exact_on_this_cpu, saturating_layers, uint8_twin
