"""A decode node: its rank processes (each runs `decode_rank`) and its front."""

from __future__ import annotations

from kvbridge.decode_node.agent import DecodeAgent
from kvbridge.decode_node.role import DecodeRole
from kvbridge.engine.llm import resolve_device
from kvbridge.kv_transfer import KVReceiverEndpoint, ReceiverConfig, remove_stale_segments
from kvbridge.kv_transfer.factory import drivable
from kvbridge.kv_transfer.layout import RankInfo, dtype_name, node_layout
from kvbridge.pipeline import codec
from kvbridge.pipeline import dist as pp_dist
from kvbridge.pipeline.group import RankContext, RankGroup, RankSetup
from kvbridge.pipeline.messages import Fail
from kvbridge.pipeline.rank0 import Rank0Loop
from kvbridge.pipeline.stage import StageLoop
from kvbridge.serving.config import NodeConfig
from kvbridge.serving.front import NodeFront

RESERVE_TOKENS = 64  # free room kept for decoding when a request's pages are preallocated


def decode_rank(ctx: RankContext) -> RankSetup:
    """What one rank process of a decode node runs: rank 0 the loop with DecodeRole, the others a
    stage; every rank receives its layers' KV into its pool (KVReceiverEndpoint, DecodeAgent)."""
    pp = ctx.pp
    chan = ctx.control_channel()
    agent = DecodeAgent(ctx.rank, None, chan, ctx.recorder)
    agent.receiver = receiver = make_receiver(ctx, agent.on_change)
    link = pp_dist.Link(ctx.data_group)

    def close() -> None:
        chan.stop()
        receiver.close()

    if ctx.rank == 0:
        scheduler = ctx.make_scheduler(receiver.pool, evict="retract")  # a prompt it never had cannot be recomputed
        loop = Rank0Loop(
            ctx.stage, receiver.pool, scheduler, link, pp.pp_size, pp.pp_loop_size, ctx.inbox, ctx.outbox, agent,
            role=DecodeRole(chan, receiver, reserve_tokens=RESERVE_TOKENS), recorder=ctx.recorder,
        )  # fmt: skip
    else:
        loop = StageLoop(ctx.rank, pp.pp_size, ctx.stage, receiver.pool, link, agent, ctx.model.tokenizer, ctx.recorder)
    endpoint = codec.to_json(receiver.endpoint)  # (the rank's start-up report to the front)
    return RankSetup(loop, endpoint=endpoint, close=close)


def make_receiver(ctx: RankContext, on_change) -> KVReceiverEndpoint:
    """This rank's KV receiver, which owns its KV pool (exported, for the prefill ranks to write)."""
    config, mc = ctx.config, ctx.model.config
    lo, hi = ctx.stage.layer_range
    return KVReceiverEndpoint(
        ReceiverConfig(
            rank=ctx.rank,
            layer_start=lo,
            layer_end=hi,
            num_pages=config.total_pages,
            page_size=config.page_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=dtype_name(ctx.stage.dtype),
            device=str(ctx.stage.device),
            host=ctx.role_args.get("host", "127.0.0.1"),
            backends=ctx.role_args.get("backends"),
            awaits_first_token=ctx.rank == 0,
            stream_idle_s=config.kv_stream_idle_s,
        ),
        on_change=on_change,
    )


def receiving_backends(config: NodeConfig, device) -> tuple[str, ...]:
    """Every backend that moves pools on the device, but a TCPStore per rank only where torch may be used."""
    torch_too = config.transfer_backend in ("auto", "torch")
    return tuple(b for b in drivable(device) if b != "torch" or torch_too)


class DecodeNode:
    """The rank processes, the front, and this node's KV layout (with every rank's receiver)."""

    def __init__(self, config: NodeConfig, progress: bool = False):
        pp = config.pp
        remove_stale_segments()  # pools of decode ranks killed before they could unlink them
        self.device = resolve_device(config.engine.device)
        backends = receiving_backends(config, self.device)
        role_args = {"host": config.host, "backends": backends}
        self.ranks = RankGroup(config.engine, pp, progress=progress, build=decode_rank, role_args=role_args)
        self.front = NodeFront(self.ranks)
        ranks = tuple(codec.from_json(RankInfo, self.ranks.endpoints[r]) for r in range(pp.pp_size))
        self.layout = node_layout(config.engine, self.ranks.model, ranks, backends)

    def fail(self, rid: str, code: str, error: str) -> None:
        self.ranks.inbox.put(Fail(rid, code, error))

    def shutdown(self):
        self.front.close()
        return self.ranks.shutdown()
