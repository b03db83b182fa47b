"""A pipeline-parallel node: `pp_size` rank processes (spawned), fronted by this object.

    node = RankGroup(EngineConfig(model="tiny-random"), PPConfig(pp_size=3))
    [c] = node.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))
    reports = node.shutdown()   # every rank's decision log and final state

Rank 0 runs pipeline/rank0.py, the others pipeline/stage.py. Requests reach rank 0
through a queue; token and finish events come back through another. With num_hosts > 1,
each host starts its own share of the ranks; the host with rank 0 is the front.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.multiprocessing as mp

from kvbridge.common import logs, rpc, tracing
from kvbridge.common.metrics import RankFiles, init_rank_metrics
from kvbridge.common.progress import Progress
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.security import Security
from kvbridge.engine import faults
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.llm import Completion, resolve_device, resolve_dtype
from kvbridge.engine.model import ModelStage, stage_ranges
from kvbridge.engine.pages import PageAllocator
from kvbridge.engine.prefix_cache import PrefixCache
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.weights import LoadedModel, load_model
from kvbridge.pipeline import cores
from kvbridge.pipeline import dist as pp_dist
from kvbridge.pipeline.messages import Abort, Add, CacheEvents, Finish, Pairing, Shutdown, Token
from kvbridge.pipeline.metrics import RankRecorder

READY_POLL_S = 0.25  # while ranks start: how often the front looks for one that died


@dataclass(frozen=True)
class RankReport:
    rank: int
    log: list[tuple[int, str, str]]  # (seq, kind, rid) of the decisions the rank applied (the latest 100k)
    live_requests: int  # requests the rank still tracks (0 after a clean shutdown)
    pages_used: int  # rank 0 only: pages its allocator still hands out (-1 elsewhere)
    error: str = ""  # the exception that ended the rank, if any
    log_count: int = 0  # decisions the rank applied
    log_digest: str = ""  # digest of all of them, in order


class RankGroup:
    def __init__(
        self,
        config: EngineConfig,
        pp: PPConfig,
        progress: bool = True,
        timeout_s: float = 120.0,
        build: Callable[[RankContext], RankSetup] | None = None,
        role_args: dict | None = None,
    ):
        self.config, self.pp = config, pp
        self.endpoints: dict[int, dict] = {}  # rank -> what its role published when ready
        self.model = load_model(config.model, progress=progress)  # warms the weight cache for the ranks
        mc = self.model.config
        self.max_context = min(config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox, self.reports = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.rank_files = RankFiles()  # the ranks' Prometheus series, read by the front's registry
        # each local rank's decision log position, published by the rank (invariant checks compare them)
        self.positions = {rank: ctx.RawValue("q", 0) for rank in pp.local_ranks}
        # a single-host node's rendezvous listens on a port bound here and handed to rank 0 (a port
        # merely picked free could be taken by another node starting at the same moment)
        listener = None if pp.dist_init_addr else socket.create_server(("127.0.0.1", 0), backlog=1024)
        addr = pp.dist_init_addr or f"127.0.0.1:{listener.getsockname()[1]}"
        # every rendezvous key under a prefix only this node's ranks know (the store takes any
        # writer); ranks on other hosts (num_hosts > 1) could not learn it, so none then
        store_key = secrets.token_hex(16) if pp.num_hosts == 1 else ""
        threads = config.threads  # 0: each rank takes its share of the host's cores (pipeline/cores.py)
        self.procs = [
            ctx.Process(
                target=rank_main,
                args=(
                    rank,
                    build or colocated_rank,
                    asdict(config),
                    asdict(pp),
                    addr,
                    threads,
                    timeout_s,
                    self.inbox,
                    self.outbox,
                    self.reports,
                    role_args or {},
                    self.rank_files.path,
                    self.positions[rank],
                    rpc.security().as_dict(),
                    store_key,
                    listener if rank == 0 else None,
                ),
                name=f"kvbridge-pp{rank}",
                daemon=True,
            )
            for rank in pp.local_ranks
        ]
        try:
            for p in self.procs:
                p.start()
        finally:
            if listener is not None:
                listener.close()  # rank 0 holds its own copy
        self._ids = itertools.count()
        self._pending: dict[str, dict] = {}  # rid -> collected events
        try:
            self._wait_ready(progress, timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, progress: bool, timeout_s: float) -> None:
        """Until every rank reports ready; RuntimeError naming the rank when one reports an error,
        dies without a report, or none is ready within timeout_s."""
        deadline = time.monotonic() + timeout_s
        with Progress(f"starting {len(self.procs)} pipeline ranks", len(self.procs), enabled=progress) as bar:
            while len(self.endpoints) < len(self.procs):
                try:
                    msg = self.reports.get(timeout=READY_POLL_S)
                except queue.Empty:
                    self._check_starting(deadline, timeout_s)
                    continue
                if msg.get("error"):
                    self.kill()
                    raise RuntimeError(f"pipeline rank {msg['rank']} failed to start: {msg['error']}")
                self.endpoints[msg["rank"]] = msg.get("endpoint", {})
                bar.advance()

    def _check_starting(self, deadline: float, timeout_s: float) -> None:
        """Raise if a rank exited before every rank was ready, or the wait is over. (A rank whose
        start failed in rank_main reports why and exits 0: that report is on its way.)"""
        for rank, p in zip(self.pp.local_ranks, self.procs):
            if p.exitcode is not None and (p.exitcode != 0 or rank in self.endpoints):
                raise RuntimeError(f"pipeline rank {rank} exited with status {p.exitcode} while the node started")
        if time.monotonic() > deadline:
            waiting = sorted(set(self.pp.local_ranks) - set(self.endpoints))
            raise RuntimeError(f"pipeline ranks {waiting} not ready within {timeout_s:g} s")

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        pairing: Pairing | None = None,
        cache_salt: str = "",
        resumed: int = 0,
        fork_of: str = "",
        trace: str = "",
    ) -> str:
        """Queue a request at rank 0 (messages.Add: pairing, a disaggregated request's half; resumed,
        the last prompt ids are a migrated request's outputs so far; fork_of, a choice i > 0's
        choice 0; trace, its traceparent)."""
        vocab = self.model.config.vocab_size
        if params.n != 1:
            raise ValueError(f"n is {params.n}: a rank group runs one choice a request (NodeFront forks the others)")
        if len(prompt_ids) <= resumed:
            raise ValueError("prompt is empty")
        bad = [i for i, t in enumerate(prompt_ids) if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            field = "prompt" if bad[0] < len(prompt_ids) - resumed else "resume_ids"
            raise ValueError(f"{field} token id {prompt_ids[bad[0]]} is out of range [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}")
        prompt = len(prompt_ids) - resumed  # (max_new_tokens and min_tokens count the resumed outputs)
        params = params.resolved(prompt, self.max_context, self.config.max_default_tokens)
        if resumed >= params.max_new_tokens:
            limit = params.max_new_tokens
            raise ValueError(f"resume_ids has {resumed} tokens: max_new_tokens={limit} leaves none to generate")
        pages = -(-min(prompt + params.max_new_tokens, self.max_context) // self.config.page_size)
        if pages > self.config.total_pages:
            raise ValueError(f"request needs {pages} KV pages; the pool has {self.config.total_pages}")
        rid = rid or f"req-{next(self._ids)}"
        if rid in self._pending:
            raise ValueError(f"duplicate request id {rid!r}")
        self._pending[rid] = {"arrival": time.perf_counter(), "first": None, "done": None}
        self.inbox.put(Add(rid, tuple(prompt_ids), params, pairing, cache_salt, resumed, fork_of, trace))
        return rid

    def forget(self, rid: str) -> None:
        """Stop tracking a finished request (callers that read the events themselves, like NodeFront)."""
        self._pending.pop(rid, None)

    def abort(self, rid: str, reason: str = "") -> None:
        """End the request on every rank; a `reason` is the error it ends with (a client's abort has none)."""
        self.inbox.put(Abort(rid, reason))

    def log_positions(self) -> dict[int, int]:
        """Decisions each local rank has applied (rank 0: made)."""
        return {rank: v.value for rank, v in self.positions.items()}

    def dead_ranks(self) -> list[int]:
        """Local ranks whose process has exited (a node with one is broken for good)."""
        return [rank for rank, p in zip(self.pp.local_ranks, self.procs) if not p.is_alive()]

    def poll(self, timeout: float | None = None) -> list[Token | Finish]:
        """Events that arrived (token / finish), waiting up to `timeout` for the first. (Without a
        front, nobody streams the prefix cache's changes: they are dropped here.)"""
        events = []
        try:
            events.append(self.outbox.get(timeout=timeout) if timeout else self.outbox.get_nowait())
            while True:
                events.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        events = [ev for ev in events if not isinstance(ev, CacheEvents)]
        now = time.perf_counter()
        for ev in events:
            st = self._pending.get(ev.rid)
            if st is None:
                continue
            if isinstance(ev, Token) and st["first"] is None:
                st["first"] = now
            elif isinstance(ev, Finish):
                st["done"] = ev
                st["finish_s"] = now
        return events

    def completion(self, rid: str) -> Completion | None:
        """The finished request's result (removed from tracking), or None while it runs."""
        st = self._pending.get(rid)
        if st is None or st["done"] is None:
            return None
        del self._pending[rid]
        ev = st["done"]
        first = st["first"] or st["finish_s"]
        return Completion(
            rid=rid,
            prompt_tokens=ev.prompt_tokens,
            output_ids=list(ev.output_ids),
            text=ev.text,
            finish_reason=ev.finish_reason,
            ttft_s=first - st["arrival"],
            e2e_s=st["finish_s"] - st["arrival"],
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], timeout_s: float = 600
    ) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        deadline = time.monotonic() + timeout_s
        done: dict[str, Completion] = {}
        while len(done) < len(rids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(rids) - len(done)} of {len(rids)} requests unfinished after {timeout_s}s")
            self._check_alive()
            self.poll(timeout=0.2)
            for rid in rids:
                if rid not in done and (c := self.completion(rid)) is not None:
                    done[rid] = c
        return [done[r] for r in rids]

    def _check_alive(self) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"pipeline rank process died: {', '.join(dead)}")

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout_s: float = 60) -> list[RankReport]:
        """Abort what is left, stop every rank, and return their reports (rank order)."""
        self.inbox.put(Shutdown())
        reports = []
        try:
            for _ in self.procs:
                reports.append(RankReport(**self.reports.get(timeout=timeout_s)))
        finally:
            for p in self.procs:
                p.join(timeout=10)
            self.kill()
        return sorted(reports, key=lambda r: r.rank)

    def kill(self) -> list[int]:
        """Kill every rank still alive; returns the pids of all of them (their shared memory may be left)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.rank_files.close()
        return [p.pid for p in self.procs if p.pid is not None]


@dataclass
class RankContext:
    """What a rank process has when its role is built (see `colocated_rank`)."""

    rank: int
    config: EngineConfig
    pp: PPConfig
    model: LoadedModel
    stage: ModelStage  # this rank's layers
    data_group: object  # torch.distributed group for descriptions, hidden states, tokens
    control_group: object  # pipeline.dist.ControlGroups: consensus rounds and nudges
    inbox: object  # rank 0: requests from the front
    outbox: object  # rank 0: events to the front
    role_args: dict  # role-specific settings from the front
    recorder: RankRecorder  # what this rank counts (pipeline/metrics.py)

    @property
    def max_context(self) -> int:
        mc = self.model.config
        return min(self.config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)

    def control_channel(self):
        """This rank's consensus channel (pipeline/control.py). A failed channel: rank 0's loop wakes
        and its role's next take_decisions raises; any other rank ends at once."""
        from kvbridge.pipeline.control import ControlChannel, GlooTransport, end_rank
        from kvbridge.pipeline.messages import Wake

        pp, lead = self.pp, self.rank == 0
        transport = GlooTransport(self.control_group, self.rank, pp.pp_size) if pp.pp_size > 1 else None
        wake = (lambda: self.inbox.put(Wake())) if lead else None
        fail = (lambda e: wake()) if lead else end_rank
        return ControlChannel(
            self.rank, pp.pp_size, transport, on_decisions=wake, collect=lead, on_failure=fail, recorder=self.recorder
        )

    def make_scheduler(self, pool: KVPool, **options) -> Scheduler:
        """Rank 0's scheduler, with the dynamic chunk planner when asked for (profiles now).
        options: Scheduler's (hold_finished, evict)."""
        policy = None
        if self.pp.enable_dynamic_chunking:
            from kvbridge.engine.profile import plan_chunks, prefill_timer

            policy = plan_chunks(self.config, prefill_timer([self.stage], [pool]), self.max_context, progress=False)
        mc = self.model.config
        allocator = PageAllocator(self.config.total_pages, None if self.config.disable_prefix_cache else PrefixCache())
        return Scheduler(
            self.config, allocator, self.max_context, self.model.tokenizer, mc.eos_token_ids, policy, **options
        )


@dataclass
class RankSetup:
    """A built role: the loop to run, and what the front learns when the rank is ready."""

    loop: object  # has run() -> list[LogEntry]; rank 0 also .requests and .scheduler
    endpoint: dict = field(default_factory=dict)  # e.g. a decode rank's receiver address
    close: Callable[[], None] = lambda: None  # frees what the role holds (shared memory, servers)


def colocated_rank(ctx: RankContext) -> RankSetup:
    from kvbridge.pipeline.rank0 import Rank0Loop
    from kvbridge.pipeline.stage import StageLoop

    pool = ctx.stage.new_kv_pool(ctx.config.total_pages, ctx.config.page_size)
    link = pp_dist.Link(ctx.data_group)
    if ctx.rank == 0:
        scheduler = ctx.make_scheduler(pool)
        pp = ctx.pp
        loop = Rank0Loop(
            ctx.stage, pool, scheduler, link, pp.pp_size, pp.pp_loop_size, ctx.inbox, ctx.outbox, recorder=ctx.recorder
        )
        return RankSetup(loop)
    loop = StageLoop(
        ctx.rank, ctx.pp.pp_size, ctx.stage, pool, link, tokenizer=ctx.model.tokenizer, recorder=ctx.recorder
    )
    return RankSetup(loop)


def rank_main(
    rank,
    build,
    config,
    pp,
    addr,
    threads,
    timeout_s,
    inbox,
    outbox,
    reports,
    role_args,
    metrics_dir,
    position,
    security,
    store_key,
    listener=None,
) -> None:
    """Entry point of a rank process. `build(RankContext)` makes its RankSetup (a module-level
    function: spawn hands it to the child by reference)."""
    # the front decides when ranks stop (Ctrl-C or SIGTERM to the process group must not kill
    # them before they free their shared memory); if the front itself dies, they stop on their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    closers: list[Callable[[], None]] = []
    _exit_with_parent(rank, closers)
    recorder = RankRecorder(init_rank_metrics(metrics_dir))  # before any series is made
    logs.setup()  # the front's level, inherited through the environment
    if tracing.setup_from_env(f"-rank{rank}"):  # the front's collector, inherited the same way
        closers.append(tracing.shutdown)
    rpc.configure(Security(**security))  # the front's TLS: KV receivers and senders are servers and channels
    config, pp = EngineConfig(**config), PPConfig(**pp)
    faults.init(config.fault_inject, rank)
    try:
        if threads:
            torch.set_num_threads(threads)
        else:
            cores.join()
            closers.append(cores.leave)
        model = load_model(config.model, progress=False)
        device = resolve_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
        layers = stage_ranges(model.config.num_hidden_layers, pp.pp_size)[rank]
        stage = ModelStage(model.config, model.weights, layers, device, resolve_dtype(config.dtype, device))
        data_group, control_group = pp_dist.init(rank, pp.pp_size, addr, timeout_s, store_key, listener)
        ctx = RankContext(rank, config, pp, model, stage, data_group, control_group, inbox, outbox, role_args, recorder)
        built: RankSetup = build(ctx)
    except Exception as e:
        reports.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        cores.leave()
        return
    built.loop.log.position = position
    closers.append(built.close)
    reports.put({"rank": rank, "ready": True, "endpoint": built.endpoint})
    try:
        log = built.loop.run()
        live = len(built.loop.requests) if rank == 0 else len(built.loop.live)
        pages = built.loop.scheduler.allocator.num_used if rank == 0 else -1
        reports.put(
            {
                "rank": rank,
                "log": list(log.recent),
                "log_count": log.count,
                "log_digest": log.digest,
                "live_requests": live,
                "pages_used": pages,
            }
        )
    except Exception as e:
        reports.put({"rank": rank, "log": [], "live_requests": -1, "pages_used": -1, "error": repr(e)})
        raise
    finally:
        built.close()
        cores.leave()


def _exit_with_parent(rank: int, closers: list[Callable[[], None]]) -> None:
    """A thread that ends this rank when the front process is gone (killed with -9, say): it frees
    what the role holds (shared memory segments) and exits, instead of lingering as an orphan."""
    from multiprocessing import parent_process
    from multiprocessing.connection import wait

    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        print(f"kvbridge rank {rank}: the front process is gone; exiting", file=sys.stderr, flush=True)

        def close_all() -> None:
            for close in closers:
                with contextlib.suppress(Exception):
                    close()

        done = threading.Thread(target=close_all, daemon=True)
        done.start()
        done.join(5)  # bounded: a peer rank may be gone too
        os._exit(1)

    threading.Thread(target=watch, name="kvbridge-parent-watch", daemon=True).start()
