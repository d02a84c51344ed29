"""``MSGPackSerializer``: hivemind's helper for msgpack-able records.

Tuples come back as tuples (msgpack would make them lists), and classes registered with
``@MSGPackSerializer.ext_serializable(code)`` (with ``packb()`` and ``unpackb()``) travel
as msgpack extension types. Used by programs that store their own records in the DHT.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import msgpack

__all__ = ["MSGPackSerializer", "SerializerBase"]


class SerializerBase(abc.ABC):
    @staticmethod
    @abc.abstractmethod
    def dumps(obj: object) -> bytes: ...

    @staticmethod
    @abc.abstractmethod
    def loads(buf: bytes) -> object: ...


class MSGPackSerializer(SerializerBase):
    _ext_types: dict[int, type] = {}
    _ext_type_codes: dict[type, int] = {}
    _TUPLE_EXT_TYPE_CODE = 0x40

    @classmethod
    def ext_serializable(cls, type_code: int) -> Callable[[type], type]:
        """Register a class (with ``packb() -> bytes`` and ``unpackb(bytes)``) under
        ``type_code`` (0..127, not 0x40, which tuples use; each code once)."""
        if not isinstance(type_code, int) or not 0 <= type_code <= 127:
            raise ValueError(f"type_code must be an int in [0, 127], got {type_code!r}")
        if type_code == cls._TUPLE_EXT_TYPE_CODE:
            raise ValueError(f"type_code {type_code:#x} is taken by tuples")

        def wrap(wrapped_type: type) -> type:
            for method in ("packb", "unpackb"):
                if not callable(getattr(wrapped_type, method, None)):
                    raise TypeError(f"{wrapped_type.__name__} must define {method}()")
            known = cls._ext_types.get(type_code)
            if known is not None and known is not wrapped_type:
                raise ValueError(f"type_code {type_code} is taken by {known.__name__}")
            cls._ext_types[type_code] = wrapped_type
            cls._ext_type_codes[wrapped_type] = type_code
            return wrapped_type

        return wrap

    @classmethod
    def _encode(cls, obj: Any) -> msgpack.ExtType:
        code = cls._ext_type_codes.get(type(obj))
        if code is not None:
            return msgpack.ExtType(code, obj.packb())
        if isinstance(obj, tuple):
            return msgpack.ExtType(cls._TUPLE_EXT_TYPE_CODE, cls.dumps(list(obj)))
        raise TypeError(f"cannot serialize {type(obj).__name__} with msgpack")

    @classmethod
    def _decode(cls, code: int, data: bytes) -> Any:
        if code == cls._TUPLE_EXT_TYPE_CODE:
            return tuple(cls.loads(data))
        if code in cls._ext_types:
            return cls._ext_types[code].unpackb(data)
        raise ValueError(f"unknown msgpack extension type {code}")

    @classmethod
    def dumps(cls, obj: object) -> bytes:
        return msgpack.packb(obj, use_bin_type=True, default=cls._encode, strict_types=True)

    @classmethod
    def loads(cls, buf: bytes) -> object:
        return msgpack.unpackb(buf, ext_hook=cls._decode, raw=False, strict_map_key=False)
