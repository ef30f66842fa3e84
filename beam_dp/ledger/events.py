"""DpEvents as JSON, losslessly: what the ledger stores for every charge.

dp_accounting's events are attrs classes; each is written as ``{"type": class name, field:
value, ...}``, nested events recursively. Floats keep every bit (Python writes the shortest
repr that reads back to the same double, and ``Infinity``/``NaN`` are kept), ints stay ints,
and a tuple is tagged so that it does not come back as a list (``ComposedDpEvent((a, b))`` and
``ComposedDpEvent([a, b])`` are different attrs values). Only the event classes listed here can
be read back: a ledger is shared storage, so a stored name never selects an arbitrary class.
"""
from __future__ import annotations

import json
import numbers

import attr
from dp_accounting import dp_event

from beam_dp.accounting import ApproxDpEvent, PureDpEvent

# Every event class dp_accounting defines, and the project's own.
EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in vars(dp_event).values()
    if isinstance(cls, type) and issubclass(cls, dp_event.DpEvent) and cls is not dp_event.DpEvent
}
EVENT_TYPES[PureDpEvent.__name__] = PureDpEvent
EVENT_TYPES[ApproxDpEvent.__name__] = ApproxDpEvent   # stored; the Renyi filter refuses it

_TUPLE = "__tuple__"


def _encode(value):
    if isinstance(value, dp_event.DpEvent):
        cls = type(value)
        if EVENT_TYPES.get(cls.__name__) is not cls:
            raise ValueError(f"cannot store a {cls.__module__}.{cls.__name__} in the ledger: "
                             f"not one of the known DpEvent classes")
        encoded = {"type": cls.__name__}
        for field in attr.fields(cls):
            encoded[field.name] = _encode(getattr(value, field.name))
        return encoded
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):     # numpy ints too (json cannot write those)
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    raise ValueError(f"cannot store {type(value).__name__} {value!r} in a DpEvent")


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TUPLE}:
        return tuple(_decode(v) for v in value[_TUPLE])
    name = value.get("type")
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown DpEvent type {name!r} in the ledger")
    return cls(**{k: _decode(v) for k, v in value.items() if k != "type"})


def event_to_json(event: dp_event.DpEvent) -> str:
    """The event as a JSON string (keys sorted: the same event always gives the same text)."""
    if not isinstance(event, dp_event.DpEvent):
        raise ValueError(f"expected a DpEvent, got {type(event).__name__}")
    return json.dumps(_encode(event), sort_keys=True)


def event_from_json(text: str) -> dp_event.DpEvent:
    """The inverse of ``event_to_json``: an event equal to the one written."""
    return _decode(json.loads(text))
