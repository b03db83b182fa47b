"""The typed records of a node's pipeline log (pipeline/log.py RECORDS, kv_transfer/handoff.py) and
their one codec (pipeline/codec.py): each kind carries its own record, built where it enters the
node; on the wire between ranks every field is checked, and a record that does not fit is refused
with the path of the field that does not (tests/nodes/test_fuzz_wire.py fuzzes the same decoder)."""

from __future__ import annotations

import json

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.kv_transfer.handoff import Destination, Registration
from kvbridge.kv_transfer.layout import Endpoint, NodeLayout, PageGeometry, RankInfo
from kvbridge.kv_transfer.rooms import Source
from kvbridge.pipeline import codec
from kvbridge.pipeline.log import ADMIT, APPEND, FINISH, RETRACT, ROUTE, Admitted, Appended, LogEntry, Message, Pages

LAYOUT = NodeLayout(
    PageGeometry(16, 3, 64, "bfloat16"),
    num_layers=30,
    num_pages=512,
    ranks=(
        RankInfo(0, 0, 15, "127.0.0.1:7001", (Endpoint("shm", b"kvbridge-1"), Endpoint("grpc"))),
        RankInfo(1, 15, 30, endpoints=(Endpoint("cuda_ipc", b"\x00\xff"),)),
    ),
    model_fingerprint="f00",
    backends=("shm", "grpc"),
)
REGISTRATION = Registration(7, bytes(range(16)), "shm", (3, 4, 5), 2, LAYOUT, "10.0.0.2:7002")
DESTINATION = Destination(7, (9, 10), 1, (Source(0, 0, 15), Source(1, 15, 30)), "shm", b"\x01" * 16)
ENTRIES = (
    LogEntry(0, ADMIT, "a", SamplingParams(), Admitted(2, (1, 2, 3), 1, DESTINATION)),
    LogEntry(1, ROUTE, "a", None, REGISTRATION),
    LogEntry(2, RETRACT, "a", None, Pages((9, 10))),
    LogEntry(3, APPEND, "a", None, Appended((42,))),
    LogEntry(4, FINISH, "a"),
)


def wire_with(record_json) -> bytes:
    """A CONTROL message whose one ROUTE entry carries `record_json` as its record."""
    return json.dumps({"kind": "control", "decisions": [[0, ROUTE, "a", None, record_json]], "batch": None}).encode()


def test_every_record_crosses_the_wire_as_it_was():
    msg = Message("control", ENTRIES)
    assert Message.decode(msg.encode()) == msg
    raw = json.loads(msg.encode())["decisions"][1][4]
    assert raw["secret"] == bytes(range(16)).hex() and raw["decode"]["ranks"][1]["endpoints"] == [
        {"backend": "cuda_ipc", "data": "00ff"}
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("held_pages"), "Registration: .*missing 1 required positional argument: 'held_pages'"),
        (lambda r: r.update(held_page=1), "Registration has unknown fields: held_page"),
        (lambda r: r.update(room="7"), "Registration.room must be int, got str"),
        (lambda r: r.update(room=True), "Registration.room must be int, got bool"),
        (lambda r: r.update(secret="zz"), "Registration.secret is not hex"),
        (lambda r: r.update(page_ids=[3, 4.5]), r"Registration.page_ids\[1\] must be int, got float"),
        (lambda r: r["decode"]["ranks"][1].update(rank=None), r"Registration.decode.ranks\[1\].rank must be int"),
        (lambda r: r["decode"].update(geometry=[16]), "Registration.decode.geometry must be an object, got list"),
    ],
)
def test_a_record_that_does_not_fit_is_refused_naming_the_field(change, message):
    record = codec.to_json(REGISTRATION)
    change(record)
    with pytest.raises(ValueError, match=f"malformed pipeline message: ValueError.*{message}"):
        Message.decode(wire_with(record))


def test_an_entry_holds_its_kinds_record_and_no_other():
    """Where a record is made (rank 0's decide), a wrong one is a TypeError at once; on the wire, a
    kind without a record that carries one is refused."""
    with pytest.raises(TypeError, match="route entries hold Registration, got Pages"):
        LogEntry(0, ROUTE, "a", None, Pages((1,)))
    with pytest.raises(TypeError, match="admit entries hold Admitted, got NoneType"):
        LogEntry(0, ADMIT, "a", SamplingParams())
    with pytest.raises(TypeError, match="finish entries hold no record, got Pages"):
        LogEntry(0, FINISH, "a", None, Pages(()))
    finish = json.dumps({"kind": "control", "decisions": [[0, FINISH, "a", None, {"pages": []}]], "batch": None})
    with pytest.raises(ValueError, match="a finish entry carries no record"):
        Message.decode(finish.encode())
