"""A QuantizeLinear / DequantizeLinear pair as one JAX primitive, and the jax2onnx plugin that writes it as those
two ONNX nodes: jax2onnx has no quantization ops, so a fake-quantized tensor would otherwise export as the float
arithmetic that computes it (Div, Round, Clip...), which the int8 converter cannot read as a quantized tensor.

The primitive computes exactly what the pair computes in onnxruntime: ``(clip(round_half_even(x / scale) + zp)
- zp) * scale``, per tensor or along ``axis``. recal binds it only in a finalized QAT model (no gradient needed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

qdq_p = Primitive("recal_qdq")


def _broadcast(v, x, axis):
    if axis is None or np.ndim(v) == 0:
        return v
    shape = [1] * x.ndim
    shape[axis] = -1
    return jnp.reshape(v, shape)


def _qdq_math(x, scale, zero_point, *, axis, qmin, qmax):
    s = _broadcast(scale, x, axis)
    zp = _broadcast(zero_point, x, axis).astype(x.dtype)
    q = jnp.clip(jnp.round(x / s) + zp, qmin, qmax)
    return (q - zp) * s


qdq_p.def_impl(_qdq_math)
qdq_p.def_abstract_eval(lambda x, scale, zero_point, **params: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(qdq_p, mlir.lower_fun(_qdq_math, multiple_results=False))


def qdq(x, scale, zero_point, axis: int | None = None):
    """``x`` through QuantizeLinear / DequantizeLinear with ``scale`` (float32) and ``zero_point`` (uint8: an
    activation, 0..255; int8: a weight, -128..127), per tensor or per index of ``axis``. Concrete qparams (an export:
    Keras calls the model on its variables' values) become the ONNX graph's constants."""
    zero_point = jnp.asarray(zero_point)
    info = np.iinfo(zero_point.dtype)
    return qdq_p.bind(x, jnp.asarray(scale, jnp.float32), zero_point, axis=axis, qmin=int(info.min),
                      qmax=int(info.max))


def _register_with_jax2onnx() -> None:
    """The jax2onnx plugin (registered once, when this module is imported with jax2onnx installed)."""
    from jax2onnx.plugins.plugin_system import PrimitiveLeafPlugin, register_primitive

    @register_primitive(jaxpr_primitive=qdq_p.name, context="primitives.recal", component="qdq", since="recal",
                        onnx=[{"component": "QuantizeLinear"}, {"component": "DequantizeLinear"}], testcases=[])
    class QDQPlugin(PrimitiveLeafPlugin):
        def lower(self, ctx, eqn) -> None:
            x, scale, zero_point = (ctx.get_value_for_var(v, name_hint=ctx.fresh_name("qdq_in")) for v in eqn.invars)
            out_var = eqn.outvars[0]
            out_spec = ctx.get_value_for_var(out_var, name_hint=ctx.fresh_name("qdq_out"))
            axis = eqn.params["axis"]
            kwargs = {} if axis is None else {"axis": int(axis)}
            q = ctx.builder.QuantizeLinear(x, scale, zero_point, _outputs=[ctx.fresh_name("quantized")], **kwargs)
            name = out_spec.name if getattr(out_spec, "producer", None) is None else ctx.fresh_name("qdq_out")
            result = ctx.builder.DequantizeLinear(q, scale, zero_point, _outputs=[name], **kwargs)
            result.type, result.shape = out_spec.type, out_spec.shape
            ctx.bind_value_for_var(out_var, result)


try:
    _register_with_jax2onnx()
except ImportError:  # no jax2onnx: the primitive still computes; exporting asks for jax2onnx first
    pass
