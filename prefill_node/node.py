"""A prefill node: its rank processes (each runs `prefill_rank`) and its front."""

from __future__ import annotations

from kvbridge.engine.llm import resolve_device
from kvbridge.engine.model import stage_ranges
from kvbridge.kv_transfer.factory import drivable
from kvbridge.kv_transfer.layout import RankInfo, node_layout
from kvbridge.pipeline import dist as pp_dist
from kvbridge.pipeline.group import RankContext, RankGroup, RankSetup
from kvbridge.pipeline.rank0 import Rank0Loop
from kvbridge.pipeline.stage import StageLoop
from kvbridge.prefill_node.agent import PrefillAgent
from kvbridge.prefill_node.role import PrefillRole
from kvbridge.serving.config import NodeConfig
from kvbridge.serving.front import NodeFront


def prefill_rank(ctx: RankContext) -> RankSetup:
    """What one rank process of a prefill node runs: rank 0 the loop with PrefillRole, the others a
    stage; every rank pushes its layers' KV (PrefillAgent)."""
    pp = ctx.pp
    pool = ctx.stage.new_kv_pool(ctx.config.total_pages, ctx.config.page_size)
    chan = ctx.control_channel()
    agent = PrefillAgent(ctx.rank, ctx.rank == pp.pp_size - 1, pool, chan, ctx.recorder)
    link = pp_dist.Link(ctx.data_group)

    def close() -> None:
        chan.stop()
        agent.close()

    if ctx.rank == 0:
        scheduler = ctx.make_scheduler(pool, hold_finished=True)  # pages live until every rank's pushes landed
        loop = Rank0Loop(
            ctx.stage, pool, scheduler, link, pp.pp_size, pp.pp_loop_size, ctx.inbox, ctx.outbox, agent,
            role=PrefillRole(chan), recorder=ctx.recorder,
        )  # fmt: skip
    else:
        loop = StageLoop(ctx.rank, pp.pp_size, ctx.stage, pool, link, agent, ctx.model.tokenizer, ctx.recorder)
    return RankSetup(loop, close=close)


class PrefillNode:
    """The rank processes, the front, and this node's KV layout."""

    def __init__(self, config: NodeConfig, progress: bool = False):
        backend, pp = config.transfer_backend, config.pp
        drives = drivable(resolve_device(config.engine.device))  # (cuda_ipc needs pools on a GPU, shm in memory)
        if backend != "auto" and backend not in drives:
            raise ValueError(f"transfer backend must be auto or one of {', '.join(drives)}, got {backend!r}")
        self.ranks = RankGroup(config.engine, pp, progress=progress, build=prefill_rank)
        self.front = NodeFront(self.ranks)
        ranges = stage_ranges(self.ranks.model.config.num_hidden_layers, pp.pp_size)
        ranks = tuple(RankInfo(i, lo, hi) for i, (lo, hi) in enumerate(ranges))
        offered = drives if backend == "auto" else (backend,)
        self.layout = node_layout(config.engine, self.ranks.model, ranks, offered)

    def shutdown(self):
        self.front.close()
        return self.ranks.shutdown()
