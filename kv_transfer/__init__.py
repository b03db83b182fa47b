"""Moving KV pages from prefill ranks to decode ranks.

A prefill node's rank i owns model layers [ps, pe) of a pool of pages; a decode node's rank j
owns [ds, de) of its own pool. Page ids are node-wide. For every (i, j) whose ranges overlap,
rank i copies the overlapping layers of each prompt page p (its id) into page q (the id the
decode node registered) of rank j's pool. PP sizes are independent (layers.overlaps).

Operations, who calls them, and when (in request order):

Decode rank (one KVReceiverEndpoint per rank process; ReceiverConfig):
  KVReceiverEndpoint(config, on_change=None)
      at start-up. Owns the rank's KVPool (`.pool`; in /dev/shm for CPU, IPC-exported for CUDA)
      and serves the KVReceiver gRPC service; opens each backend's receiving half. `.endpoint`
      (RankInfo, with each backend's endpoint) is what the node publishes in its KVLayout
      (adapters.rank_to_proto).
  expect(room, rid, page_ids, sources, backend)
      once the room's pages are preallocated, BEFORE registering with the prefill node:
      its destination pages here, the prefill ranks (wire.sources_of(prefill_layout)) and
      the backend chosen by choose_backend. The room is WAITING_FOR_INPUT.
  poll(room) / reason(room) / pop_changes() / on_change(StatusChange)
      any time: the room's KVPoll here. SUCCESS = every overlapping prefill rank's pages
      landed and its TransferDone arrived (on rank 0 with awaits_first_token: and the first
      token): feed READY into consensus `transferred`; FAILED: feed FAILED.
  first_token(room)
      rank 0, after SUCCESS: (token, prompt_tokens) sent by the prefill node's last rank.
  fail(room, reason)
      on the daemon's own timeout or abort.
  forget(room)
      when the request leaves the transfer queue (joined decoding, failed, aborted): waits for
      copies into its pages in flight; later writes and notices of the room are refused (NOT_FOUND).
      With shm/cuda_ipc the prefill rank writes directly: reuse an aborted room's pages only after
      every prefill rank revoked it (the prefill side's revoke(), below).
  close()
      at shutdown: stops the service, unlinks the pool's segment.
  remove_segments_of(pid)
      the node daemon, when a rank process died without close(): unlinks its segments.
  remove_stale_segments()
      a starting decode node: unlinks every kvbridge segment whose creating process is gone.

Prefill rank (one Sender per backend per rank process; make_sender(name, pool, rank)):
  choose_backend(prefill_layout, decode_layout, device)
      decode rank 0, when it registers a room: "auto" -> a backend name for RegisterRequest.
  connect(room, decode_layout, page_ids, rid)
      when the room's registration is applied (consensus `bootstrapped` waits for every
      rank's WAITING_FOR_INPUT). Non-blocking, like everything below: a worker thread runs
      the calls in order.
  push(room, src_page_ids, dst_page_ids, num_tokens)
      after each prefill chunk: pages whose contents changed (a partial last page is pushed
      again with the next chunk). The room is TRANSFERRING.
  send_first_token(room, token, prompt_tokens)
      the last prefill rank, after sampling, before finish.
  finish(room, num_tokens)
      after the last push: TransferDone to every overlapping decode rank once the pushes
      landed. SUCCESS when all acknowledged (consensus `transferred`: pages may be freed).
  abort(room, reason)
      on abort or timeout: FAILED here and a TransferDone with the error to the decode ranks.
  revoke(room, then)
      when the request ends early (abort, timeout, the decode node's Bootstrap.Revoke): no write
      into the room starts any more, its queued pushes are dropped, and then() runs once no write
      into it is under way. The decode node hands the room's pages out again only after every
      prefill rank did this (shm and cuda_ipc write into its pool directly).
  poll(room) / reason(room) / pop_changes() / on_change, forget(room), close()
      as on the decode side (forget: revoke without waiting for the report).

KVPoll (poll.py): BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS, or FAILED
from any non-terminal state; moving backwards or out of a terminal state raises.

Backends (backends/): shm, cuda_ipc, torch, grpc, each one module with both halves
(backends/base.py: a Sender subclass, a Receiving, a check of a peer's endpoint) registered in
factory.REGISTRY, whose order is auto's preference. Every backend's TransferDone and
FirstToken notices go over gRPC to the decode rank's KVReceiver, which checks every page id, layer
and byte count it is told about.
"""

from kvbridge.kv_transfer.backends.shm import remove_segments_of, remove_stale_segments
from kvbridge.kv_transfer.factory import BACKENDS, CHOICES, REGISTRY, choose_backend, make_sender
from kvbridge.kv_transfer.layers import overlap, overlaps
from kvbridge.kv_transfer.layout import Endpoint, NodeLayout, PageGeometry, RankInfo, incompatibility, local_host_id
from kvbridge.kv_transfer.poll import IllegalTransition, KVPoll, PollState, StatusChange
from kvbridge.kv_transfer.receiver import KVReceiverEndpoint, ReceiverConfig
from kvbridge.kv_transfer.rooms import Source
from kvbridge.kv_transfer.sender import Sender, SenderConfig

__all__ = [
    "BACKENDS",
    "CHOICES",
    "REGISTRY",
    "Endpoint",
    "IllegalTransition",
    "KVPoll",
    "KVReceiverEndpoint",
    "NodeLayout",
    "PageGeometry",
    "PollState",
    "RankInfo",
    "ReceiverConfig",
    "Sender",
    "SenderConfig",
    "Source",
    "StatusChange",
    "choose_backend",
    "incompatibility",
    "local_host_id",
    "make_sender",
    "overlap",
    "overlaps",
    "remove_segments_of",
    "remove_stale_segments",
]
