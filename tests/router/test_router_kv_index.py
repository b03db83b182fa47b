"""One node's block index (router/kv_index.py): batches applied exactly, gaps and overflow clear
it, overlap stops at the first missing block."""

from __future__ import annotations

import pytest

from kvbridge.router.kv_index import CLEARED, REMOVED, STORED, Batch, BlockIndex, Event, batch_from_proto
from kvbridge.v1 import kv_events_pb2


def snapshot(seq: int, hashes, page_size: int = 4) -> Batch:
    return Batch(seq, True, (Event(STORED, list(hashes)),), page_size)


def change(seq: int, kind: str, hashes=(), page_size: int = 4) -> Batch:
    return Batch(seq, False, (Event(kind, list(hashes)),), page_size)


def synced(hashes=(1, 2, 3), seq: int = 5) -> BlockIndex:
    index = BlockIndex()
    assert index.apply(snapshot(seq, hashes)) is None
    return index


def test_snapshot_then_stored_removed_cleared_are_applied_exactly():
    index = synced()
    assert (index.hashes(), index.seq, index.page_size) == ({1, 2, 3}, 5, 4)
    assert index.apply(change(6, STORED, [4, 5])) is None
    assert index.apply(change(7, REMOVED, [2, 9])) is None
    assert (index.hashes(), index.seq) == ({1, 3, 4, 5}, 7)
    assert index.apply(change(8, CLEARED)) is None
    assert (index.hashes(), index.seq, index.synced) == (frozenset(), 8, True)
    assert index.apply(snapshot(20, [7])) is None  # a snapshot replaces whatever was known
    assert (index.hashes(), index.seq) == ({7}, 20)


def test_a_batch_out_of_sequence_is_a_gap_that_clears_the_index():
    for bad in (change(7, STORED, [4]), change(5, STORED, [4]), change(6, STORED, [4], page_size=8)):
        index = synced()
        assert index.apply(bad) == "gap"
        assert (index.hashes(), index.seq, index.page_size, index.synced) == (frozenset(), None, 0, False)
        assert index.apply(change(8, STORED, [4])) == "gap"  # nothing but a snapshot resyncs it
        assert index.apply(snapshot(9, [1, 4])) is None
        assert (index.hashes(), index.seq) == ({1, 4}, 9)


def test_changes_before_any_snapshot_are_a_gap():
    assert BlockIndex().apply(change(1, STORED, [1])) == "gap"


def test_more_blocks_than_the_bound_clear_the_index():
    index = BlockIndex(max_blocks=3)
    assert index.apply(snapshot(1, [1, 2, 3])) is None
    assert index.apply(change(2, STORED, [4])) == "overflow"
    assert (len(index), index.synced) == (0, False)
    assert index.apply(snapshot(3, [1, 2, 3, 4])) == "overflow"
    assert (len(index), index.synced) == (0, False)


def test_overlap_counts_from_the_first_block_to_the_first_missing():
    index = synced([10, 11, 13])
    assert index.overlap([10, 11, 12, 13]) == 2
    assert index.overlap([11, 10]) == 2
    assert index.overlap([12, 10, 11]) == 0
    assert index.overlap([]) == 0


def test_proto_batches_convert_and_bad_ones_are_refused():
    msg = kv_events_pb2.KVEventBatch(
        seq=3, snapshot=True, page_size=16, role="prefill",
        events=[kv_events_pb2.KVEvent(kind=kv_events_pb2.KVEvent.STORED, block_hashes=[2**64 - 1, 5])],
    )  # fmt: skip
    assert batch_from_proto(msg) == Batch(3, True, (Event(STORED, [2**64 - 1, 5]),), 16, "prefill")
    with pytest.raises(ValueError, match="unknown kind 0"):
        batch_from_proto(kv_events_pb2.KVEventBatch(page_size=4, events=[kv_events_pb2.KVEvent()]))
    with pytest.raises(ValueError, match="without a page size"):
        batch_from_proto(kv_events_pb2.KVEventBatch(snapshot=True))
