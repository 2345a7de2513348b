"""AIMET's encodings file: the scales and offsets ``QuantizationSimModel.export`` writes beside the float ONNX model
(its classic QAT export, and what Qualcomm's runtimes read), validated once (pydantic) into one form for
:mod:`recal_onnx.passes.encodings_to_qdq`.

Two layouts are read: the versions up to 0.6.1 (a dict by tensor name of encodings, several for a per-channel one;
``bitwidth``, ``offset``, ``scale``, ``dtype`` "int" / "float") and 1.0.0 (lists of entries with ``name``, ``bw``,
``dtype`` INT / FLOAT, ``enc_type``, ``offset`` and ``scale`` lists; the offset says whether it is symmetric). AIMET
means ``x = (q + offset) * scale`` for ``q`` in ``[0, 2**bw - 1]``, ``round`` half to even: a QuantizeLinear of zero
point ``-offset``. The file is data: read bounded, parsed by ``json``, every field checked, and a wrong one named by
its section, tensor and field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pydantic

from recal_core.input_gate import read_bounded

from .errors import ModelError

MAX_BYTES = 256 * 1024 * 1024  # an LLM's per-channel encodings fit many times over
SECTIONS = ("activation_encodings", "param_encodings")


@dataclass(frozen=True)
class Encoding:
    """One tensor's quantization as the standard ops take it: integer ``bits``, per tensor or per channel."""

    name: str
    param: bool  # a parameter (a weight or bias initializer), not an activation
    bits: int
    floating: bool  # AIMET simulates this tensor in float (16 bits): no integer form
    offsets: np.ndarray  # int64, one a channel (or one)
    scales: np.ndarray  # float32, as many


class _Legacy(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore", strict=False)
    bitwidth: int = pydantic.Field(ge=1, le=32)
    dtype: Literal["int", "float"] = "int"
    offset: float | None = None  # an integer encoding's are required (checked in _from_legacy), a float one has none
    scale: float | None = None


class _Entry(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")
    name: str
    bw: int = pydantic.Field(ge=1, le=32)
    dtype: Literal["INT", "FLOAT", "int", "float"] = "INT"
    enc_type: Literal["PER_TENSOR", "PER_CHANNEL"] = "PER_TENSOR"
    offset: list[float] = []
    scale: list[float] = []


class _V1(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")
    version: str
    activation_encodings: list[_Entry] = []
    param_encodings: list[_Entry] = []


class _V0(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")
    version: str = "0.4.0"
    activation_encodings: dict[str, list[_Legacy]] = {}
    param_encodings: dict[str, list[_Legacy]] = {}


def load_encodings(source: str | os.PathLike | dict, name: str = "the encodings") -> list[Encoding]:
    """The encodings of ``source`` (a path to AIMET's ``.encodings`` JSON, or its parsed dict), validated; a
    :class:`ModelError` names what is wrong and where."""
    if not isinstance(source, dict):
        name = str(source)
        try:
            source = json.loads(read_bounded(source, MAX_BYTES, "encodings file"), object_pairs_hook=_unique_keys)
        except RecursionError:
            raise ModelError(f"{name}: nested deeper than a JSON parser can follow; not an AIMET encodings "
                             "file") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelError(f"{name}: not a JSON encodings file ({exc})") from None
    if not isinstance(source, dict) or not any(k in source for k in SECTIONS):
        raise ModelError(f"{name}: not an AIMET encodings file (no {' or '.join(SECTIONS)})")
    legacy = not str(source.get("version", "0.4.0")).startswith(("1.", "2."))
    if str(source.get("version", "")).startswith("2."):
        raise ModelError(f"{name}: encodings version {source['version']}; the converter reads versions up to 0.6.1 "
                         "and 1.0.0, which AIMET's QuantizationSimModel.export writes (1.0.0 by default); with 2.x "
                         "AIMET exports by aimet_torch.onnx.export, whose QDQ model converts without encodings")
    try:
        parsed = (_V0 if legacy else _V1).model_validate(source)
    except pydantic.ValidationError as exc:
        raise ModelError(f"{name}: {_first_error(exc, source)}") from None
    found = []
    for section in SECTIONS:
        param = section == "param_encodings"
        entries = getattr(parsed, section)
        if legacy:
            for tensor, encodings in entries.items():
                found.append(_from_legacy(name, section, tensor, encodings, param))
        else:
            found.extend(_from_entry(name, section, entry, param) for entry in entries)
    seen: dict[str, bool] = {}
    for e in found:
        if e.name in seen:
            raise ModelError(f"{name}: tensor {e.name!r} has two encodings ({'param' if seen[e.name] else 'activation'}"
                             f"_encodings and {'param' if e.param else 'activation'}_encodings); one tensor has one")
        seen[e.name] = e.param
    return found


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once: a key given twice (which ``json`` would keep the last of,
    silently) is refused, named."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one object; which one is meant is not said")
        out[key] = value
    return out


def _from_legacy(name: str, section: str, tensor: str, encodings: list[_Legacy], param: bool) -> Encoding:
    if not encodings:
        raise ModelError(f"{name}: {section}[{tensor!r}] is empty; expected one encoding, or one a channel")
    kinds = {(e.bitwidth, e.dtype) for e in encodings}
    if len(kinds) > 1:
        raise ModelError(f"{name}: {section}[{tensor!r}]: its channels differ in bit width or type ({sorted(kinds)})")
    bits, dtype = kinds.pop()
    missing = [f for f in ("offset", "scale") if dtype == "int" and any(getattr(e, f) is None for e in encodings)]
    if missing:
        raise ModelError(f"{name}: {section}[{tensor!r}]: an integer encoding without its {missing[0]}")
    return _checked(name, f"{section}[{tensor!r}]", Encoding(
        tensor, param, bits, dtype == "float", np.array([e.offset or 0.0 for e in encodings]),
        np.array([e.scale or 0.0 for e in encodings], np.float64)))


def _from_entry(name: str, section: str, entry: _Entry, param: bool) -> Encoding:
    where = f"{section} entry {entry.name!r}"
    floating = entry.dtype.upper() == "FLOAT"
    if not floating and (not entry.scale or len(entry.offset) != len(entry.scale)):
        raise ModelError(f"{name}: {where}: {len(entry.scale)} scales and {len(entry.offset)} offsets; expected as "
                         "many of each, at least one")
    if entry.enc_type == "PER_TENSOR" and len(entry.scale) > 1:
        raise ModelError(f"{name}: {where}: PER_TENSOR with {len(entry.scale)} scales")
    return _checked(name, where, Encoding(entry.name, param, entry.bw, floating, np.array(entry.offset),
                                          np.array(entry.scale, np.float64)))


def _checked(name: str, where: str, e: Encoding) -> Encoding:
    """Integral offsets within the bit width's grid, finite positive scales, integer bit widths of 2 to 32."""
    if e.floating:
        return Encoding(e.name, e.param, e.bits, True, np.zeros(0, np.int64), np.zeros(0, np.float32))
    if not 2 <= e.bits <= 32:
        raise ModelError(f"{name}: {where}: bit width {e.bits}; expected 2 to 32")
    if not np.all(np.isfinite(e.offsets)) or np.any(e.offsets != np.round(e.offsets)) or np.any(
            e.offsets > 0) or np.any(e.offsets < -(2 ** e.bits - 1)):
        shown = [int(o) if np.isfinite(o) and o == round(o) else float(o) for o in e.offsets[:4]]
        raise ModelError(f"{name}: {where}: offset {shown} is not an integer in "
                         f"[{-(2 ** e.bits - 1)}, 0] (x = (q + offset) * scale, q in [0, 2**{e.bits} - 1])")
    scales = e.scales.astype(np.float32)
    if not np.all(np.isfinite(scales)) or not np.all(scales > 0):
        raise ModelError(f"{name}: {where}: scale {e.scales[:4].tolist()} is not finite and positive in float32")
    return Encoding(e.name, e.param, e.bits, False, e.offsets.astype(np.int64), scales)


def _first_error(exc: pydantic.ValidationError, source: dict) -> str:
    """pydantic's first error as section, tensor and field."""
    error = exc.errors()[0]
    loc = list(error["loc"])
    where = []
    if loc and loc[0] in SECTIONS:
        section = source.get(loc[0])
        where.append(str(loc[0]))
        if len(loc) > 1:
            key = loc[1]
            tensor = (section[key].get("name") if isinstance(section, list) and isinstance(key, int)
                      and key < len(section) and isinstance(section[key], dict) else key)
            where.append(f"tensor {tensor!r}")
        rest = [str(p) for p in loc[2:] if not isinstance(p, int)]
        if rest:
            where.append(f"field {'.'.join(rest)!r}")
    else:
        where.append(f"field {'.'.join(map(str, loc))!r}")
    return f"{', '.join(where)}: {error['msg']} (got {error.get('input')!r:.60})"
