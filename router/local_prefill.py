"""Local prefill: a decode node computes a short (or mostly cached) prompt itself while the prefill
nodes' queue is long, instead of the prompt waiting there behind the others (issue 41). The router
decides per disaggregated attempt, after it picked the decode node D, from what it counts itself:

    uncached     the prompt's tokens (with a migration's resumed ones) less the prefix D's cache holds
                 (router/kv_index.py; 0 when unknown)
    prefill      the prompt tokens queued at the least-queued eligible prefill node: routed there and
                 not yet handed off (its Pick.tokens, pending until its Prefill call returns; counted
                 by cache_aware once the nodes are indexed: under least_loaded or round_robin, or
                 before the index, it reads 0 and nothing goes local)
    decode       the prompt tokens queued at D: prompts routed to it locally and not yet computed
                 (pending until its first response)

    local  iff  uncached <= --local-prefill-max-tokens
           and  prefill > --local-prefill-ratio x (decode + uncached)

So an idle prefill node always gets the prompt (its queue is 0), and D takes a prompt only while the
prefill queue is longer, by the ratio, than what D would compute before this prompt's first token:
the ratio is what a decode node's prefill costs its decodes and is slower by (it shares its steps and
its chunked-prefill budget with them). `--local-prefill-max-tokens 0` turns it off. A prompt that asks
for prompt logprobs always goes to the prefill node (the prefill node computes them on the P/D path).

D gets the request with a PrefillRoute{local: true} (no room, no prefill node) signed with the fleet
key over the request's rid (no caller but the router makes a decode node prefill): its rank 0
schedules the prompt as any request (chunked prefill, prefix cache; decode_node/service.py), and the
tokens are those of the P->D path (the same model and kernels; a row's bits do not depend on how its
prompt was cut). Each decision is counted, kvbridge_router_local_prefill_decisions_total{decision,
reason}: decision local | prefill, reason one of REASONS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.common import rpc
from kvbridge.common.security import message_proof
from kvbridge.v1 import generation_pb2

if TYPE_CHECKING:
    from kvbridge.router.pool import Node, Pick
    from kvbridge.router.routed import Routed

# local: the prefill queue is long enough; the others say why the prompt went to the prefill node
REASONS = ("prefill_queue", "long_prompt", "short_queue", "no_prefill_node", "prompt_logprobs", "unknown_length")


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: str  # one of REASONS

    @property
    def label(self) -> str:
        return "local" if self.local else "prefill"


@dataclass(frozen=True)
class LocalPrefill:
    max_tokens: int = 0  # a prompt with more uncached tokens on the decode node goes to a prefill node; 0: off
    ratio: float = 4.0  # the prefill queue must exceed this times the decode node's (with this prompt)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0 (0: off), got {self.max_tokens}")
        if not 0 < self.ratio < float("inf"):
            raise ValueError(f"local_prefill_ratio must be > 0 and finite, got {self.ratio}")

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def decide(
        self, uncached: int | None, prefill_queued: int | None, decode_queued: int, prompt_logprobs: bool = False
    ) -> Decision:
        """uncached: the prompt tokens the decode node would compute (None: the prompt's length is not
        known here, a text prompt before the router has a tokenizer); prefill_queued: the least-queued
        eligible prefill node's queued prompt tokens (None: no prefill node is eligible); decode_queued:
        the decode node's. Pure: the same inputs give the same decision."""
        if prompt_logprobs:
            return Decision(False, "prompt_logprobs")
        if uncached is None:
            return Decision(False, "unknown_length")
        if uncached > self.max_tokens:
            return Decision(False, "long_prompt")
        if prefill_queued is None:
            return Decision(False, "no_prefill_node")
        if prefill_queued > self.ratio * (decode_queued + uncached):
            return Decision(True, "prefill_queue")
        return Decision(False, "short_queue")


def consider(routed: Routed, picked: Pick, excluded: list[Node]) -> Decision | None:
    """The rule applied to an attempt whose decode node is `picked` (counted; None while it is off).
    The caller serves a local decision with `local_route()` and counts `uncached(...)` as D's queue."""
    rule = routed.config.local_prefill
    if not rule.enabled:
        return None
    node = picked.node
    left_out = [*excluded, *routed.unpaired.prefill_of(node)]
    prefill = routed.pool.queued_tokens("prefill", left_out, routed.gateway_prefill)
    asked = routed.request.sampling.HasField("prompt_logprobs") and not routed.output_ids
    decision = rule.decide(uncached(routed, picked), prefill, node.pending_tokens, asked)
    routed.dispatcher.metrics.local_prefill_decided(decision)
    return decision


def uncached(routed: Routed, picked: Pick) -> int | None:
    """The prompt tokens (with a migration's resumed ones) the decode node lacks; None when unknown."""
    if not routed.prompt_tokens:
        return None
    return max(routed.prompt_tokens + len(routed.output_ids) - picked.cached, 0)


def local_route(rid: str) -> generation_pb2.PrefillRoute:
    """A decode node's route to compute the prompt of request `rid` itself, signed with the fleet key
    over the rid too (a local route's fields are always the same: the proof serves that rid only)."""
    route = generation_pb2.PrefillRoute(local=True)
    route.proof = message_proof(rpc.security().fleet(), route, rid.encode())
    return route
