"""An elastic node: rank processes (each runs `elastic_rank`) built for every role at once, and its
front. Each rank makes its KV receiver (which owns the pool: exported, so prefill ranks of other
nodes can write it), one consensus channel, and both agents over that pool; rank 0 makes one
scheduler and an ElasticRole (elastic_node/role.py). A switch swaps which agent and which role act,
nothing else: weights, pool, pages and the prefix cache stay."""

from __future__ import annotations

from kvbridge.decode_node.agent import DecodeAgent
from kvbridge.decode_node.node import RESERVE_TOKENS, make_receiver, receiving_backends
from kvbridge.decode_node.role import DecodeRole
from kvbridge.elastic_node.role import ElasticAgent, ElasticRole
from kvbridge.engine.llm import resolve_device
from kvbridge.kv_transfer import remove_stale_segments
from kvbridge.kv_transfer.factory import drivable
from kvbridge.kv_transfer.layout import RankInfo, node_layout
from kvbridge.pipeline import codec
from kvbridge.pipeline import dist as pp_dist
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.group import RankContext, RankGroup, RankSetup
from kvbridge.pipeline.messages import Fail
from kvbridge.pipeline.rank0 import Rank0Loop
from kvbridge.pipeline.roles import ColocatedRole
from kvbridge.pipeline.stage import StageLoop
from kvbridge.prefill_node.agent import PrefillAgent
from kvbridge.prefill_node.role import PrefillRole
from kvbridge.serving.config import NodeConfig
from kvbridge.serving.front import NodeFront


def elastic_rank(ctx: RankContext) -> RankSetup:
    """What one rank process of an elastic node runs (role_args["role"]: the role it starts in)."""
    pp, rank = ctx.pp, ctx.rank
    chan = ctx.control_channel()
    decode = DecodeAgent(rank, None, chan, ctx.recorder)
    decode.receiver = receiver = make_receiver(ctx, decode.on_change)
    pool = receiver.pool
    prefill = PrefillAgent(rank, rank == pp.pp_size - 1, pool, chan, ctx.recorder)
    agent = ElasticAgent({"prefill": prefill, "decode": decode, "colocated": KVAgent()}, ctx.role_args["role"])
    link = pp_dist.Link(ctx.data_group)

    def close() -> None:
        chan.stop()
        prefill.close()
        receiver.close()

    if rank == 0:
        make = {
            "prefill": lambda: PrefillRole(chan),
            "decode": lambda: DecodeRole(chan, receiver, reserve_tokens=RESERVE_TOKENS),
            "colocated": ColocatedRole,
        }
        role = ElasticRole(make, agent.role)
        scheduler = ctx.make_scheduler(pool)  # (ElasticRole sets what differs per role)
        loop = Rank0Loop(
            ctx.stage, pool, scheduler, link, pp.pp_size, pp.pp_loop_size, ctx.inbox, ctx.outbox, agent,
            role=role, recorder=ctx.recorder,
        )  # fmt: skip
        agent.live = lambda: len(loop.requests)
    else:
        loop = StageLoop(rank, pp.pp_size, ctx.stage, pool, link, agent, ctx.model.tokenizer, ctx.recorder)
        agent.live = lambda: len(loop.live)
    return RankSetup(loop, endpoint=codec.to_json(receiver.endpoint), close=close)


class ElasticNode:
    """The rank processes, the front, and the node's KV layout for each role: as a decode node (its
    ranks' receivers) and as a prefill node (what it offers to push with)."""

    def __init__(self, config: NodeConfig, role: str, progress: bool = False):
        pp, backend = config.pp, config.transfer_backend
        remove_stale_segments()  # pools of ranks killed before they could unlink them
        self.device = resolve_device(config.engine.device)
        drives = drivable(self.device)
        if backend != "auto" and backend not in drives:
            raise ValueError(f"transfer backend must be auto or one of {', '.join(drives)}, got {backend!r}")
        backends = receiving_backends(config, self.device)
        role_args = {"host": config.host, "backends": backends, "role": role}
        self.role = role
        self.ranks = RankGroup(config.engine, pp, progress=progress, build=elastic_rank, role_args=role_args)
        self.front = NodeFront(self.ranks)
        model = self.ranks.model
        receivers = tuple(codec.from_json(RankInfo, self.ranks.endpoints[r]) for r in range(pp.pp_size))
        self.layouts = {
            "decode": node_layout(config.engine, model, receivers, backends),
            "prefill": node_layout(
                config.engine,
                model,
                tuple(RankInfo(r.rank, r.layer_start, r.layer_end) for r in receivers),
                drives if backend == "auto" else (backend,),
            ),
        }

    @property
    def layout(self):
        """The layout of the role it has now (a colocated node's is never asked for)."""
        return self.layouts["decode" if self.role == "decode" else "prefill"]

    def fail(self, rid: str, code: str, error: str) -> None:
        self.ranks.inbox.put(Fail(rid, code, error))

    def shutdown(self):
        self.front.close()
        return self.ranks.shutdown()
