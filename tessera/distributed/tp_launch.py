"""Tensor-parallel ranks: rank 0 lives in the scheduler process, ranks 1..N-1 are started here as processes
(`python -m tessera.entrypoints.tp_rank`, through platform/launch.py; they exit when their parent dies).

Every step the scheduler broadcasts one message to the group (torch.distributed's object broadcast):
("step", ForwardInput), ("flush",) or ("stop",).
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess

from tessera.config import ServerArgs
from tessera.distributed.heartbeat import watch_ranks
from tessera.distributed.parallel_state import broadcast_object, init_tensor_parallel
from tessera.platform.device import resolve_device
from tessera.platform.launch import spawn

RANK_MODULE = "tessera.entrypoints.tp_rank"


def rendezvous(args: ServerArgs) -> str:
    """The TP group's init method: node 0's --dist-init-addr across nodes, a free local port on one."""
    return f"tcp://{args.dist_init_addr}" if args.nnodes > 1 else free_init_method()


def spawn_ranks(args: ServerArgs, ranks: range, init_method: str) -> list[subprocess.Popen]:
    settings = dataclasses.asdict(args)
    return [spawn(RANK_MODULE, [str(rank), init_method], settings) for rank in ranks]


def run_node(args: ServerArgs) -> int:
    """`tessera serve --node-rank k` (k > 0): this node's TP ranks, until node 0 stops them."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    procs = spawn_ranks(args, range(first, first + per_node), rendezvous(args))
    print(f"Tessera node {args.node_rank}/{args.nnodes}: TP ranks {first}..{first + per_node - 1}, "
          f"rendezvous {args.dist_init_addr}", flush=True)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        codes = [p.wait() for p in procs]
    return max(codes, default=0)


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class TPGroupHandle:
    """Rank 0's view: starts the other ranks, broadcasts the step messages, stops them."""

    def __init__(self, args: ServerArgs):
        self.size = args.tp_size
        self.broken = False  # a broadcast failed: some rank (maybe on another node) is gone
        init_method = rendezvous(args)
        # Node 0 starts its own ranks 1..per_node-1; the other nodes start theirs (run_node).
        self.procs = spawn_ranks(args, range(1, args.tp_size // args.nnodes), init_method)
        init_tensor_parallel(0, self.size, init_method, resolve_device(args.device))
        self.stopping = False
        watch_ranks(range(args.tp_size // args.nnodes, args.tp_size), lambda: self.stopping)

    @property
    def alive(self) -> bool:
        """Every rank is there: this node's processes are running, and the group still carries a message. The
        ranks on other nodes are no processes of ours: a dead one shows only as a collective that fails
        (gloo/NCCL: connection closed), so after a failed step (the only time the scheduler asks) one ping
        goes round; a group that cannot carry it is gone for good."""
        if self.broken or not all(p.poll() is None for p in self.procs):
            return False
        try:
            self.broadcast(("ping",))
        except Exception:  # noqa: BLE001 - whatever the backend raises, the group is unusable
            return False
        return True

    def broadcast(self, msg: tuple) -> None:
        dead = [p.pid for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) {dead} exited; restart the server")
        try:
            broadcast_object(msg)
        except Exception:
            self.broken = True  # a remote rank went away (or the link did): no collective can be trusted again
            raise

    def stop(self) -> None:
        self.stopping = True  # the ranks on other nodes go quiet now: that is no failure
        try:
            self.broadcast(("stop",))
        except Exception:  # a dead rank: nothing to tell it
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

