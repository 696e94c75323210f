"""Tensor-parallel model workers: rank 0 lives in the scheduler process, ranks 1..N-1 are started here.

Every step the scheduler broadcasts one message to the group (torch.distributed's object broadcast):
("step", ForwardInput), ("flush",) or ("stop",). All ranks run the same forward (their collectives meet);
only rank 0 samples and answers the scheduler. A rank exits when its parent (the scheduler) dies.

`python -m tessera.distributed.tp_launch RANK INIT_METHOD` with the ServerArgs JSON on stdin: a rank > 0.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

from tessera.config import ServerArgs

logger = logging.getLogger("tessera.tp")


def rendezvous(args: ServerArgs) -> str:
    """The TP group's init method: node 0's --dist-init-addr across nodes, a free local port on one."""
    return f"tcp://{args.dist_init_addr}" if args.nnodes > 1 else free_init_method()


def spawn_ranks(args: ServerArgs, ranks: range, init_method: str) -> list[subprocess.Popen]:
    import dataclasses

    cfg = json.dumps(dataclasses.asdict(args)).encode()
    procs = []
    for rank in ranks:  # settings over the pipe, never argv (`ps` would show the API key)
        proc = subprocess.Popen([sys.executable, "-m", "tessera.distributed.tp_launch", str(rank), init_method],
                                stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(cfg)
        proc.stdin.close()
        procs.append(proc)
    return procs


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
        from tessera.distributed.parallel_state import init_tensor_parallel
        from tessera.models.registry import resolve_device

        self.size = args.tp_size
        init_method = rendezvous(args)
        # Node 0 starts its own ranks 1..per_node-1; the other nodes start theirs (run_node).
        self.procs = spawn_ranks(args, range(1, args.tp_size // args.nnodes), init_method)
        init_tensor_parallel(0, self.size, init_method, resolve_device(args.device))

    @property
    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def broadcast(self, msg: tuple) -> None:
        from tessera.distributed.parallel_state import broadcast_object

        dead = [p.pid for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) {dead} exited; restart the server")
        broadcast_object(msg)

    def stop(self) -> None:
        try:
            self.broadcast(("stop",))
        except Exception:  # a dead rank: nothing to tell it
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def rank_main(args: ServerArgs, rank: int, init_method: str) -> None:
    """A rank > 0: joins the group, loads its shard of the model, then follows rank 0's messages."""
    import torch

    from tessera.distributed.parallel_state import broadcast_object, init_tensor_parallel
    from tessera.models.registry import resolve_device
    from tessera.worker.model_worker import ModelWorker

    torch.manual_seed(args.random_seed)
    torch.set_num_threads(args.worker_threads)
    init_tensor_parallel(rank, args.tp_size, init_method, resolve_device(args.device))
    worker = ModelWorker(args, set())
    while True:
        try:
            msg = broadcast_object()
        except RuntimeError:  # rank 0 (the scheduler) went away: the server is stopping
            logger.info("tp rank %d: rank 0 is gone; exiting", rank)
            os._exit(0)
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "flush":
            worker.flush_cache()
        elif kind == "step":
            try:
                worker.execute(msg[1])
            except Exception:  # rank 0 fails the batch with the same error; keep following it
                logger.exception("tp rank %d: model step failed", rank)


def main() -> None:
    from tessera.scheduler.launch import exit_with_parent

    rank, init_method = sys.argv[1:3]
    cfg = sys.stdin.read()
    logging.basicConfig(level="INFO", format=f"[%(asctime)s tp{rank}] %(message)s")
    exit_with_parent()
    rank_main(ServerArgs(**json.loads(cfg)), int(rank), init_method)


if __name__ == "__main__":
    main()
