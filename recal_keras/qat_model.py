"""A Keras model rewritten for QAT: the layers :func:`recal_keras.qat_plan.plan_qat` chose become the QAT layers
of :mod:`recal_keras.qat`, in a new model that ``keras.models.clone_model`` builds around the original layers
(and so their variables, masks and optimizer state)."""

from __future__ import annotations

import keras

from .qat_tables import QATTables
from .qat import Folded, QuantizedMerge
from .quantized_layer import QuantizedLayer
from .qat_plan import plan_qat


def quantize_model(model: keras.Model, tables: QATTables,
                   learn: tuple[bool, bool] = (False, False)) -> tuple[keras.Model, list, list[str]]:
    """A new model with the convs and Dense layers :func:`plan_qat` chose as :class:`QuantizedLayer` s and the
    merges, pools and pre-activation BatchNorms of quantized tensors as :class:`QuantizedMerge` s, reusing the
    original layers' variables (a model that holds QAT layers already, loaded from a ``.keras`` file, is itself, its
    layers switched by ``tables``); and the layers with weights left float. ``learn``: the weights' and the layers'
    inputs' scales are learned (``observer: lsq``)."""
    existing = [layer for layer in model.layers if isinstance(layer, (QuantizedLayer, QuantizedMerge))]
    if existing:  # a QAT model loaded from a .keras file: the recipe's switches take it on again
        by_name = {q.name: q for q in existing}
        for q in existing:
            q.set_tables(tables)
            source = by_name.get(q.source)
            object.__setattr__(q, "input_source", None if source is None else source.output_quantizer)
        return model, existing, [layer.name for layer in model.layers if layer.weights and layer not in existing]
    plan, floating = plan_qat(model)
    made: list[QuantizedLayer] = []

    def clone(layer):
        entry = plan.get(layer.name)
        if entry == "identity":
            return Folded(name=f"{layer.name}_folded")
        if isinstance(entry, dict) and "merge" in entry:
            merge = QuantizedMerge(entry["merge"], entry["relu"], observe_inputs=entry.get("observe_inputs"))
            merge.set_tables(tables)
            made.append(merge)
            return merge
        if isinstance(entry, dict):
            q = QuantizedLayer(entry["layer"], entry["bn"], entry["relu"], entry["quantize_input"],
                               activation=entry["activation"], learn=learn)
            q.set_tables(tables)
            made.append(q)
            return q
        return layer

    new = keras.models.clone_model(model, clone_function=clone)
    entries = {id(entry.get("layer", entry.get("merge"))): entry for entry in plan.values() if isinstance(entry, dict)}
    by_tail = {entries[id(q.layer)]["tail"]: q for q in made}
    for q in made:
        source = by_tail.get(entries[id(q.layer)].get("source"))
        q.source = None if source is None else source.name
        # not a sub-layer of q (Keras would track it as one): the quantizer of the layer it reads
        object.__setattr__(q, "input_source", None if source is None else source.output_quantizer)
    return new, made, floating
