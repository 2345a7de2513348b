"""What each layer of a Keras model becomes under QAT (:func:`plan_qat`): the quantized layers with what folds into
them, the merges of quantized tensors, and the layers left float. Read by :func:`recal_keras.qat_model.quantize_model`,
which builds the QAT model from the plan."""

from __future__ import annotations

import keras

PASS_THROUGH = (keras.layers.MaxPooling2D, keras.layers.MaxPooling1D, keras.layers.Flatten, keras.layers.Reshape,
                keras.layers.Dropout, keras.layers.ZeroPadding2D)
QUANTIZABLE = (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D, keras.layers.Dense)
RELU6 = 6.0  # the cap of the ReLU6 a QuantizedLayer folds (MobileNets'); ``relu=True`` is the plain ReLU
# activations the int8 model computes on integers (QLinearSigmoid; swish = x * sigmoid(x) with QLinearMul; hard-swish
# and hard-sigmoid as a 256-entry table of their quantized input), by the name of Keras's function
# (``Activation("swish")`` is ``silu``, ``"hard_swish"`` is ``hard_silu``)
INTEGER_ACTIVATIONS = {"sigmoid": "sigmoid", "silu": "swish", "swish": "swish", "hard_silu": "hard_swish",
                       "hard_swish": "hard_swish", "hard_sigmoid": "hard_sigmoid"}
# merges of quantized tensors that get one observer on their output (a ReLU after an Add folds in)
MERGES = (keras.layers.Add, keras.layers.Multiply, keras.layers.Concatenate)
# a BatchNormalization that folds into no layer (pre-activation: DenseNet's BN -> ReLU -> conv) on a quantized tensor
# is observed after its ReLU too: the converter makes it a depthwise conv with exact weights
# average pooling of a quantized tensor: its output observed too (QLinearAveragePool); global pooling is read by a
# quantized layer's own input observer
POOLS = (keras.layers.AveragePooling2D,)


def _relu_of(layer) -> bool | float:
    """True for a ReLU layer, :data:`RELU6` for a ReLU6, else False."""
    if isinstance(layer, keras.layers.ReLU):
        if layer.negative_slope or layer.threshold:
            return False
        return True if layer.max_value is None else RELU6 if float(layer.max_value) == RELU6 else False
    if isinstance(layer, keras.layers.Activation):
        return activation_relu(layer.activation)
    return False


def _integer_activation(layer) -> str | None:
    """The :data:`INTEGER_ACTIVATIONS` name of an ``Activation`` layer the int8 model computes on integers, else
    None."""
    if isinstance(layer, keras.layers.Activation):
        return INTEGER_ACTIVATIONS.get(getattr(layer.activation, "__name__", ""))
    return None


def activation_relu(activation) -> bool | float | None:
    """False for linear, True for relu, :data:`RELU6` for relu6, None for any other activation.

    Args:
        activation: a layer's ``activation`` function."""
    name = getattr(activation, "__name__", "")
    return {"linear": False, "relu": True, "relu6": RELU6}.get(name)


def _channels_last(bn) -> bool:
    """Whether a BatchNormalization normalizes the last axis (as the int8 model's per-channel conv does)."""
    return bn.axis in (-1, [-1], [3], 3)


def _neighbours(model: keras.Model):
    """Each layer's producer and consumer layers in ``model`` (Sequential or functional)."""
    producers, consumers = {}, {}
    for layer in model.layers:
        parents = []
        for node in layer._inbound_nodes:
            for parent in node.parent_nodes:
                if parent.operation in model.layers:
                    parents.append(parent.operation)
        producers[layer.name] = parents
        for p in parents:
            consumers.setdefault(p.name, []).append(layer)
    return producers, consumers


def _made_by_ops(layer, model: keras.Model) -> list[bool]:
    """Per input of ``layer``, whether an op the layer graph does not hold made it (``x + 3.0``, ``x * (1 / 6)`` on
    Keras tensors) rather than a layer."""
    layers = {id(each) for each in model.layers}
    node = layer._inbound_nodes[0]
    return [id(t._keras_history.operation) not in layers for t in node.arguments.keras_tensors]


def _quantized_source(layer, producers: dict, plan: dict) -> bool:
    """Whether ``layer``'s output is a quantized tensor: planned (a QAT layer, a merge, or what folded into one),
    or a pass-through of one."""
    while isinstance(layer, PASS_THROUGH) and len(producers.get(layer.name, [])) == 1:
        layer = producers[layer.name][0]
    return _quantized_output(layer.name, plan)


def _quantized_output(name: str, plan: dict) -> bool:
    """Whether the planned layer ``name`` outputs its quantized tensor (not when its own activation runs after)."""
    entry = plan.get(name)
    return entry == "identity" or isinstance(entry, dict) and not entry.get("float_output")


def plan_qat(model: keras.Model) -> tuple[dict, list[str]]:
    """``{layer name: what it becomes}`` (a QuantizedLayer's parts, a merge's, or "identity" for a folded BN, ReLU
    or activation), and the layers with weights left float.

    Args:
        model: a Sequential or functional Keras model."""
    producers, consumers = _neighbours(model)
    plan: dict[str, dict | str] = {}
    for layer in model.layers:
        if type(layer) not in QUANTIZABLE:
            continue
        if isinstance(layer, keras.layers.Conv2D) and layer.groups != 1:
            continue
        if isinstance(layer, (keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D)) and \
                layer.depth_multiplier != 1:
            continue
        own = activation_relu(layer.activation)
        parts = {"layer": layer, "bn": None, "relu": own or False, "activation": None}
        if own is None:
            parts["activation"] = INTEGER_ACTIVATIONS.get(getattr(layer.activation, "__name__", ""))
            if parts["activation"] is None:  # softmax, gelu...: the output is quantized before it, runs float
                plan[layer.name] = {**parts, "tail": layer.name, "float_output": True}
                continue
            plan[layer.name] = {**parts, "tail": layer.name}
            continue
        tail = layer
        nxt = consumers.get(tail.name, [])
        if not parts["relu"] and not isinstance(layer, keras.layers.Dense) and len(nxt) == 1 and \
                isinstance(nxt[0], keras.layers.BatchNormalization) and nxt[0].axis in (-1, [-1], [3], 3):
            parts["bn"] = tail = nxt[0]
            plan[tail.name] = "identity"
        nxt = consumers.get(tail.name, [])
        if not parts["relu"] and len(nxt) == 1 and _relu_of(nxt[0]):
            parts["relu"] = _relu_of(nxt[0])
            plan[nxt[0].name] = "identity"
            tail = nxt[0]
        elif not parts["relu"] and len(nxt) == 1 and _integer_activation(nxt[0]):
            parts["activation"] = _integer_activation(nxt[0])
            plan[nxt[0].name] = "identity"
            tail = nxt[0]
        parts["tail"] = tail.name  # the layer whose output this QuantizedLayer's output stands for
        plan[layer.name] = parts
    for layer in model.layers:  # in order: a residual Add reads earlier Adds
        preactivation = isinstance(layer, keras.layers.BatchNormalization) and layer.name not in plan and \
            _channels_last(layer)
        if (type(layer) in MERGES + POOLS or preactivation) and all(_quantized_source(p, producers, plan)
                                                                   for p in producers.get(layer.name, [])):
            parts = {"merge": layer, "relu": False, "tail": layer.name}
            nxt = consumers.get(layer.name, [])
            folds_relu = isinstance(layer, (keras.layers.Add, keras.layers.BatchNormalization))
            if folds_relu and len(nxt) == 1 and _relu_of(nxt[0]):  # after a residual Add or a pre-activation BN
                parts["relu"], parts["tail"] = _relu_of(nxt[0]), nxt[0].name
                plan[nxt[0].name] = "identity"
            made_by_ops = _made_by_ops(layer, model) if type(layer) in MERGES else []
            if any(made_by_ops):  # observed by the merge itself (MobileNetV3's hard-sigmoid gate)
                parts["observe_inputs"] = made_by_ops
            plan[layer.name] = parts
    for name, parts in plan.items():
        if isinstance(parts, dict) and isinstance(parts.get("merge"), keras.layers.BatchNormalization):
            source = producers.get(name, [])
            while len(source) == 1 and isinstance(source[0], PASS_THROUGH):
                source = producers.get(source[0].name, [])
            parts["source"] = source[0].name if len(source) == 1 else None  # its input's grid: the shift's
        if isinstance(parts, dict) and "layer" in parts:
            source = producers.get(name, [])
            while len(source) == 1 and isinstance(source[0], PASS_THROUGH):
                source = producers.get(source[0].name, [])
            # quantized already when it comes from a QAT layer (or the BN / ReLU folded into one)
            parts["quantize_input"] = not (len(source) == 1 and _quantized_output(source[0].name, plan))
            parts["source"] = None if parts["quantize_input"] else source[0].name
    floating = [layer.name for layer in model.layers if layer.name not in plan and layer.weights]
    return plan, floating
