"""Treadle's .proto must match tinker_public field for field: numbers and types are the wire."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor as d
from tinker.proto import tinker_public_pb2

from treadle.proto import treadle_wire_pb2

pytestmark = pytest.mark.unit


def _short(full_name: str | None) -> str | None:
    return full_name.rsplit(".", 1)[-1] if full_name else None


def _field_signature(field: d.FieldDescriptor) -> tuple[object, ...]:
    oneof = field.containing_oneof
    return (
        field.number,
        field.type,
        field.is_repeated,
        field.has_presence,
        _short(field.message_type.full_name) if field.message_type else None,
        _short(field.enum_type.full_name) if field.enum_type else None,
        # synthetic oneofs (proto3 `optional`) are named `_<field>`; real ones must match
        oneof.name if oneof is not None else None,
    )


def _messages(file: d.FileDescriptor) -> dict[str, d.Descriptor]:
    found: dict[str, d.Descriptor] = {}

    def walk(msg: d.Descriptor, prefix: str) -> None:
        found[prefix + msg.name] = msg
        for nested in msg.nested_types:
            walk(nested, f"{prefix}{msg.name}.")

    for msg in file.message_types_by_name.values():
        walk(msg, "")
    return found


def test_every_tinker_message_has_an_identical_twin() -> None:
    theirs = _messages(tinker_public_pb2.DESCRIPTOR)
    ours = _messages(treadle_wire_pb2.DESCRIPTOR)
    assert set(theirs) == set(ours)
    for name, their_msg in theirs.items():
        our_msg = ours[name]
        their_fields = {f.name: _field_signature(f) for f in their_msg.fields}
        our_fields = {f.name: _field_signature(f) for f in our_msg.fields}
        assert our_fields == their_fields, name
        assert their_msg.GetOptions().map_entry == our_msg.GetOptions().map_entry, name


def test_enums_match() -> None:
    theirs = tinker_public_pb2.DESCRIPTOR.enum_types_by_name
    ours = treadle_wire_pb2.DESCRIPTOR.enum_types_by_name
    assert set(theirs) == set(ours)
    for name, enum in theirs.items():
        assert {v.name: v.number for v in enum.values} == {
            v.name: v.number for v in ours[name].values
        }


def test_package_is_our_own() -> None:
    assert treadle_wire_pb2.DESCRIPTOR.package == "treadle.wire.v1"
