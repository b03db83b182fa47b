"""The node's KV event hub (serving/kv_events.py) alone: snapshot then consecutive batches, a
lagging watcher resynced by a snapshot (never a gap), streams ended by close_watchers."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.engine.prefix_cache import CLEARED, REMOVED, STORED
from kvbridge.pipeline.messages import CacheEvents
from kvbridge.serving import kv_events
from kvbridge.serving.kv_events import KVEventHub
from kvbridge.v1 import kv_events_pb2

K = kv_events_pb2.KVEvent


def _events(*pairs) -> CacheEvents:
    return CacheEvents(tuple((kind, tuple(hashes)) for kind, hashes in pairs))


def test_a_watcher_gets_a_snapshot_then_every_batch_in_order():
    async def run():
        hub = KVEventHub(page_size=16, role="prefill")
        hub.apply(_events((STORED, [1, 2, 3])))
        watch = hub.watch()
        snap = await anext(watch)
        hub.apply(_events((REMOVED, [2]), (STORED, [4])))
        hub.apply(_events((CLEARED, [])))
        hub.apply(_events((STORED, [9])))
        got = [await anext(watch) for _ in range(3)]
        await watch.aclose()
        return hub, snap, got

    hub, snap, got = asyncio.run(run())
    assert (snap.seq, snap.snapshot, snap.page_size, snap.role) == (1, True, 16, "prefill")
    assert [(e.kind, list(e.block_hashes)) for e in snap.events] == [(K.STORED, [1, 2, 3])]
    assert [b.seq for b in got] == [2, 3, 4] and not any(b.snapshot for b in got)
    assert [(e.kind, list(e.block_hashes)) for e in got[0].events] == [(K.REMOVED, [2]), (K.STORED, [4])]
    assert [e.kind for e in got[1].events] == [K.CLEARED]
    assert hub.blocks == {9} and hub.num_watchers == 0


def test_a_lagging_watcher_gets_a_fresh_snapshot_instead_of_what_it_missed(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_LAG", 3)

    async def run():
        hub = KVEventHub(page_size=4, role="decode")
        watch = hub.watch()
        assert (await anext(watch)).seq == 0
        for h in range(10, 20):  # 10 batches while it reads none
            hub.apply(_events((STORED, [h])))
        resync = await anext(watch)
        hub.apply(_events((REMOVED, [10])))
        after = await anext(watch)
        await watch.aclose()
        return resync, after

    resync, after = asyncio.run(run())
    assert resync.snapshot and resync.seq == 10 and sorted(resync.events[0].block_hashes) == list(range(10, 20))
    assert after.seq == 11 and not after.snapshot


def test_close_watchers_ends_every_stream_and_too_many_are_refused(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_WATCHERS", 2)

    async def run():
        hub = KVEventHub(page_size=4, role="colocated")
        a, b = hub.watch(), hub.watch()
        await anext(a)
        await anext(b)
        with pytest.raises(OverflowError, match="2 KV event streams are open"):
            await anext(hub.watch())
        assert hub.close_watchers() == 2
        hub.apply(_events((STORED, [1])))
        for w in (a, b):
            with pytest.raises(StopAsyncIteration):
                await anext(w)
        return hub

    assert asyncio.run(run()).num_watchers == 0


def test_a_caller_past_its_cap_ends_its_own_oldest_stream_and_past_the_total_one_more_is_refused(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_WATCHERS_PER_CALLER", 2)
    monkeypatch.setattr(kv_events, "MAX_WATCHERS", 3)

    async def run():
        hub = KVEventHub(page_size=4, role="prefill")
        a1, a2, b1, a3 = hub.watch("a"), hub.watch("a"), hub.watch("b"), hub.watch("a")
        for w in (a1, a2, b1):
            await anext(w)
        assert hub.callers() == {"a": 2, "b": 1}
        await anext(a3)  # a's third: its oldest ends
        with pytest.raises(OverflowError) as e:
            await anext(a1)
        replaced = str(e.value)
        assert hub.callers() == {"a": 2, "b": 1}
        with pytest.raises(OverflowError) as e:  # b is under its cap, but every slot is taken
            await anext(hub.watch("b"))
        refused = str(e.value)
        hub.apply(_events((STORED, [5])))
        got = [(await anext(w)).seq for w in (a2, b1, a3)]
        for w in (a2, b1, a3):
            await w.aclose()
        return hub, replaced, refused, got

    hub, replaced, refused, got = asyncio.run(run())
    assert (
        replaced
        == "a opened a newer KV event stream: one caller may have 2 (MAX_WATCHERS_PER_CALLER); its oldest is ended"
    )
    assert refused == "3 KV event streams are open, the most a node serves (MAX_WATCHERS)"
    assert got == [1, 1, 1] and hub.callers() == {}
