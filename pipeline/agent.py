"""A rank's part in moving KV pages between nodes, called from its pipeline loop.

The colocated node moves nothing: this no-op base. Prefill ranks push the pages each
chunk wrote (prefill_node/), decode ranks prepare to receive them (decode_node/).
"""

from __future__ import annotations

from kvbridge.engine.batch import ForwardBatch
from kvbridge.pipeline.log import LogEntry


class KVAgent:
    def on_decision(self, d: LogEntry) -> None:
        """Every decision of the node's log, in order, once (rank 0: as it is made)."""

    def after_forward(self, batch: ForwardBatch) -> None:
        """This rank just computed `batch` for its layers: their new K/V are in its pool."""

    def holding(self) -> int:
        """Requests whose KV this rank still moves (an elastic node switches only when none is)."""
        return 0

    def on_sampled(self, batch: ForwardBatch, tokens: list[int], logprobs: list) -> None:
        """The last rank sampled `tokens`, one per sampled request of `batch`, in order, with their
        engine.logits.Logprob (None where a request asked for none)."""
