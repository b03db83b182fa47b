"""A prefill node: its rank processes (role `prefill_role`) and its gRPC front."""

from __future__ import annotations

from engine.config import EngineConfig, PPConfig
from engine.model import stage_ranges
from kv_transfer.factory import CPU_BACKENDS
from kv_transfer.layout import RankInfo, node_layout
from pipeline import dist as pp_dist
from pipeline.control import ControlChannel, GlooTransport, end_rank
from pipeline.group import RankContext, RankGroup, RankRole
from pipeline.messages import Wake
from pipeline.stage import StageLoop
from prefill_node.agent import PrefillAgent
from prefill_node.loop import PrefillLeader
from serving.front import NodeFront

BACKENDS = CPU_BACKENDS  # the engines a prefill rank can drive here (cuda_ipc needs GPUs)


def prefill_role(ctx: RankContext) -> RankRole:
    pp = ctx.pp
    pool = ctx.stage.new_kv_pool(ctx.config.total_pages, ctx.config.page_size)
    transport = GlooTransport(ctx.control_group, ctx.rank, pp.pp_size) if pp.pp_size > 1 else None
    wake = (lambda: ctx.inbox.put(Wake())) if ctx.rank == 0 else None
    # a failed channel: rank 0's loop wakes and take_decisions raises; any other rank ends at once
    fail = (lambda e: wake()) if ctx.rank == 0 else end_rank
    chan = ControlChannel(ctx.rank, pp.pp_size, transport, on_decisions=wake, collect=ctx.rank == 0, on_failure=fail)
    agent = PrefillAgent(ctx.rank, ctx.rank == pp.pp_size - 1, pool, chan)
    link = pp_dist.Link(ctx.data_group)

    def close() -> None:
        chan.stop()
        agent.close()

    if ctx.rank == 0:
        scheduler = ctx.make_scheduler(pool)
        loop = PrefillLeader(
            ctx.stage, pool, scheduler, link, pp.pp_size, pp.pp_loop_size, ctx.inbox, ctx.outbox, agent, chan=chan
        )
    else:
        loop = StageLoop(ctx.rank, pp.pp_size, ctx.stage, pool, link, agent)
    return RankRole(loop, close=close)


class PrefillNode:
    """The rank processes, the front, and this node's KV layout."""

    def __init__(self, config: EngineConfig, pp: PPConfig, progress: bool = False, backend: str = "auto"):
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"transfer backend must be auto or one of {', '.join(BACKENDS)}, got {backend!r}")
        self.ranks = RankGroup(config, pp, progress=progress, build=prefill_role)
        self.front = NodeFront(self.ranks)
        ranges = stage_ranges(self.ranks.model.config.num_hidden_layers, pp.pp_size)
        ranks = tuple(RankInfo(i, lo, hi) for i, (lo, hi) in enumerate(ranges))
        self.layout = node_layout(config, self.ranks.model, ranks, BACKENDS if backend == "auto" else (backend,))

    def shutdown(self):
        self.front.close()
        return self.ranks.shutdown()
