"""Which eligible node gets the next request: `Policy.choose`, pure (no I/O, no locks; the pool
calls it under its lock with the candidates, their cached prefixes and a turn counter).

    least_loaded   fewest outstanding requests; ties round-robin
    round_robin    strict rotation over the eligible nodes
    cache_aware    the node that has to compute least, by its prefix cache (router/kv_index.py):
                   - load imbalanced (max - min outstanding > balance_abs_threshold and
                     max > balance_rel_threshold * min, as SGLang's gateway): least_loaded
                   - prefill and colocated nodes: min (prompt tokens - cached prefix tokens)
                     + the node's pending tokens (prompt tokens routed there and not yet released)
                   - decode nodes (any among the candidates): fewest outstanding, then the longest
                     cached prefix (the decode batch is the inter-token latency; reuse only saves
                     a transfer)
                   ties: fewest outstanding, then round-robin. Without the prompt's blocks (no
                   tokenizer yet, no node indexed): least_loaded.

Each choice has a reason, counted in kvbridge_router_routing_decisions_total{role, policy, reason}:
least_loaded, round_robin, imbalance, no_index, prefix_hit (the chosen node had a cached prefix),
no_hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("cache_aware", "least_loaded", "round_robin")
REASONS = ("least_loaded", "round_robin", "imbalance", "no_index", "prefix_hit", "no_hit", "gateway")


class Candidate(Protocol):
    role: str  # "colocated" | "prefill" | "decode"
    outstanding: int  # requests routed there and not finished
    pending_tokens: int  # prompt tokens routed there that it is expected to compute still


@dataclass(frozen=True)
class Choice:
    index: int  # into the candidates
    reason: str  # one of REASONS
    tokens: int  # prompt tokens the node is expected to compute (added to its pending_tokens)


@dataclass(frozen=True)
class Policy:
    name: str = "cache_aware"  # one of POLICIES
    balance_abs_threshold: int = 64  # outstanding requests: max - min above this ...
    balance_rel_threshold: float = 1.5  # ... and max above this times min is an imbalance

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.name!r}")

    @property
    def needs_prompt(self) -> bool:
        """choose() uses the prompt's tokens and cached prefixes."""
        return self.name == "cache_aware"

    def choose(
        self,
        nodes: Sequence[Candidate],
        turn: int,
        prompt_tokens: int = 0,
        cached: Sequence[int] | None = None,
    ) -> Choice:
        """nodes: the eligible candidates (at least one); turn: a counter the caller advances per
        choice; prompt_tokens: the prompt's length; cached: per node, the prompt tokens it holds
        (its overlap in blocks times its page size), None when unknown."""
        assert nodes, "choose() needs a candidate"
        if self.name == "round_robin":
            return Choice(turn % len(nodes), "round_robin", 0)
        if self.name == "least_loaded":
            return Choice(self._least_loaded(nodes, turn), "least_loaded", 0)
        if cached is None:
            return Choice(self._least_loaded(nodes, turn), "no_index", 0)
        if self.imbalanced(nodes):
            i = self._least_loaded(nodes, turn)
            return Choice(i, "imbalance", _to_compute(nodes[i], prompt_tokens, cached[i]))
        if any(n.role == "decode" for n in nodes):
            keys = [(n.outstanding, -cached[i]) for i, n in enumerate(nodes)]
        else:
            keys = [(prompt_tokens - cached[i] + n.pending_tokens, n.outstanding) for i, n in enumerate(nodes)]
        i = _lowest(keys, turn)
        return Choice(i, "prefix_hit" if cached[i] > 0 else "no_hit", _to_compute(nodes[i], prompt_tokens, cached[i]))

    def imbalanced(self, nodes: Sequence[Candidate]) -> bool:
        loads = [n.outstanding for n in nodes]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    @staticmethod
    def _least_loaded(nodes: Sequence[Candidate], turn: int) -> int:
        return _lowest([n.outstanding for n in nodes], turn)


def _lowest(keys: Sequence, turn: int) -> int:
    """The index of the lowest key; ties go round-robin by `turn`."""
    low = min(keys)
    tied = [i for i, k in enumerate(keys) if k == low]
    return tied[turn % len(tied)]


def _to_compute(node: Candidate, prompt_tokens: int, cached: int) -> int:
    """What the node is expected to compute of the prompt (a decode node computes none of it)."""
    return 0 if node.role == "decode" else max(prompt_tokens - cached, 0)
