"""A prompt's token ids and block hashes at the router, as the nodes compute them: `Prompts`.

cache_aware routing (router/policy.py) compares a prompt's blocks with what each node holds
(router/kv_index.py), so the router must tokenize exactly as the nodes do: it fetches a node's
tokenizer (KVEvents.GetTokenizer) the first time it needs one, keeps one per model fingerprint,
and turns prompts into ids with the nodes' own adapter (common/text/prompts.py prompt_ids). While no
tokenizer could be fetched (every fetch failed; the next try is health_retry_s later), text and
chat prompts have no blocks and are routed least-loaded ("no_index"), as are those that came while
a fetch took longer than TOKENIZER_WAIT_S; token-id prompts need no tokenizer.
The ids of a text or chat prompt go on to the nodes in its place when they serve the model whose
tokenizer made them (router/routed.py): a prompt is tokenized once per request, not once by the
router and again by each node. A text or chat prompt is tokenized only within the size that could
fit the longest context a node serves (`size_problem`, common/limits.py: the HTTP and gRPC fronts
refuse a larger one before routing it). Tokenizing, and hashing long prompts, run in the bounded
worker threads of common/text/prompts.py: the loop never waits on them, and no more than
TOKENIZE_THREADS prompts expand at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvbridge.common.blocks import block_hashes
from kvbridge.common.limits import prompt_size_problem
from kvbridge.common.logs import log_event
from kvbridge.common.text.prompts import in_worker, tokenized
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.router.pool import Node, NodePool
from kvbridge.v1 import generation_pb2, kv_events_pb2, kv_events_pb2_grpc

TOKENIZER_DEADLINE_S = 5.0  # one GetTokenizer call
TOKENIZER_WAIT_S = 3.0  # a request waits this long at most for a fetch (which goes on without it)
TOKENIZER_TRIES = 3  # nodes asked per fetch, in turn
INLINE_TOKENS = 4096  # token-id prompts up to this long are hashed on the loop (~0.2 ms), longer ones in a thread
MAX_TOKENIZERS = 8  # model fingerprints kept
log = logging.getLogger("kvbridge.router")


@dataclass(frozen=True)
class PromptBlocks:
    tokens: int  # the prompt's length in tokens
    hashes: dict[int, list[int]]  # page size -> the hashes of the prompt's full blocks at that size


@dataclass(frozen=True)
class PromptIds:
    """A text or chat prompt tokenized at the router, sent on as ids to nodes of this model."""

    ids: list[int]
    fingerprint: str  # the model whose tokenizer made them


class Prompts:
    """Block hashes of requests, with the tokenizers fetched from the pool's nodes. On the loop."""

    def __init__(self, pool: NodePool, retry_s: float):
        self.pool, self.retry_s = pool, retry_s
        self.tokenizers: dict[str, Tokenizer] = {}  # model fingerprint -> its tokenizer
        self._fetch: asyncio.Task | None = None  # the fetch under way, shared by every request waiting on it
        self._failed_at = -float("inf")  # time.monotonic() of the last fetch that got no tokenizer

    async def ids(self, request: generation_pb2.GenerateRequest) -> PromptIds | None:
        """A text or chat prompt's token ids; None for a token-id prompt, or when there is no
        tokenizer at hand or the prompt would not tokenize (the node will say why)."""
        if request.prompt.WhichOneof("kind") == "token_ids":
            return None
        tokenizer = await self.tokenizer()
        if tokenizer is None:
            return None
        try:
            ids = await tokenized(request.prompt, tokenizer, self.max_context())
        except Exception:  # ValueError, or a template's own error: the node refuses it with the reason
            return None
        return PromptIds(ids, next((f for f, t in self.tokenizers.items() if t is tokenizer), ""))

    async def blocks(
        self, request: generation_pb2.GenerateRequest, page_sizes: set[int], known: PromptIds | None
    ) -> PromptBlocks | None:
        """The request's blocks at each page size; None when there is no size to hash at, or a
        text or chat prompt has no ids (`known`: ids())."""
        if not page_sizes:
            return None
        if request.prompt.WhichOneof("kind") == "token_ids":
            ids = list(request.prompt.token_ids.ids)
        elif known is not None:
            ids = known.ids
        else:
            return None
        if len(ids) <= INLINE_TOKENS:
            return _hashed(ids, page_sizes, request.cache_salt)
        return await in_worker(_hashed, ids, page_sizes, request.cache_salt)

    def max_context(self) -> int | None:
        """The longest context a healthy node serves (None while none has reported its model)."""
        return max((m.max_context for m in self.pool.models()), default=None)

    def size_problem(self, prompt) -> str:
        """Why the router refuses `prompt` by its size before anything expands it ("" when it does
        not): too many chat messages, or too many bytes for the longest context a node serves."""
        return prompt_size_problem(prompt, self.max_context())

    async def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the fleet's model, fetched once (None while fetching fails)."""
        if (tokenizer := self._known()) is not None:
            return tokenizer
        if self._fetch is None:
            if time.monotonic() < self._failed_at + self.retry_s:
                return None
            self._fetch = asyncio.ensure_future(self._fetched())
            self._fetch.add_done_callback(self._fetch_done)
        try:
            return await asyncio.wait_for(asyncio.shield(self._fetch), TOKENIZER_WAIT_S)
        except TimeoutError:
            return None

    async def tokenizer_of(self, model: generation_pb2.ModelInfo) -> Tokenizer | None:
        """The tokenizer of `model` (by its fingerprint): kept, or fetched now (as tokenizer());
        None while none is at hand."""
        if (tokenizer := self.tokenizers.get(model.fingerprint)) is None:
            await self.tokenizer()
            tokenizer = self.tokenizers.get(model.fingerprint)
        return tokenizer

    def _known(self) -> Tokenizer | None:
        model = self.pool.agreed_model()
        if model is not None:
            return self.tokenizers.get(model.fingerprint)
        return next(iter(self.tokenizers.values())) if len(self.tokenizers) == 1 else None

    def _fetch_done(self, task: asyncio.Task) -> None:
        self._fetch = None
        if task.cancelled() or task.exception() is not None or task.result() is None:
            self._failed_at = time.monotonic()

    async def _fetched(self) -> Tokenizer | None:
        """Ask healthy nodes in turn (those serving the agreed model first)."""
        model = self.pool.agreed_model()
        nodes = [n for n in self.pool.nodes if n.healthy and n.kv_events and n.channel is not None]
        nodes.sort(key=lambda n: not (model and n.model and n.model.fingerprint == model.fingerprint))
        for node in nodes[:TOKENIZER_TRIES]:
            info = await _tokenizer_info(node)
            if info is None:
                continue
            try:
                tokenizer = await asyncio.to_thread(Tokenizer.from_json, info.tokenizer_json)
            except Exception as e:  # a bad JSON, or the tokenizers library's own (plain Exception)
                log_event(log, "tokenizer", node=node.key, error=str(e)[:200])
                continue
            if len(self.tokenizers) >= MAX_TOKENIZERS:
                self.tokenizers.pop(next(iter(self.tokenizers)))
            self.tokenizers[info.model_fingerprint] = tokenizer
            log_event(log, "tokenizer", node=node.key, fingerprint=info.model_fingerprint)
            if model is None or info.model_fingerprint == model.fingerprint:
                return tokenizer
        return None


async def _tokenizer_info(node: Node) -> kv_events_pb2.TokenizerInfo | None:
    try:
        stub = kv_events_pb2_grpc.KVEventsStub(node.channel)
        return await stub.GetTokenizer(kv_events_pb2.GetTokenizerRequest(), timeout=TOKENIZER_DEADLINE_S)
    except grpc.aio.AioRpcError as e:
        log_event(log, "tokenizer", node=node.key, code=e.code().name)
        return None


def _hashed(ids: list[int], page_sizes: set[int], salt: str) -> PromptBlocks:
    return PromptBlocks(len(ids), {size: block_hashes(ids, size, salt) for size in page_sizes})
