"""`python -m tessera.entrypoints.tp_rank RANK INIT_METHOD` (settings on stdin): a tensor-parallel rank > 0.

Started by rank 0's TPGroupHandle or by `tessera serve --node-rank k` (distributed/tp_launch.py). It joins the
group, loads its shard of the model, then follows rank 0's broadcasts: ("step", ForwardInput), ("flush",),
("lora", ...), ("ping",) or ("stop",). All ranks run the same forward (their collectives meet); only rank 0
samples and answers.
"""

from __future__ import annotations

import logging
import os
import sys

from tessera.config import ServerArgs
from tessera.platform.launch import exit_with_parent, read_settings

logger = logging.getLogger("tessera.tp")


def rank_main(args: ServerArgs, rank: int, init_method: str) -> None:
    import torch

    from tessera.distributed.heartbeat import start_beating
    from tessera.distributed.parallel_state import broadcast_object, init_tensor_parallel
    from tessera.platform.device import resolve_device
    from tessera.worker.model_worker import ModelWorker

    torch.manual_seed(args.random_seed)
    torch.set_num_threads(args.worker_threads)
    init_tensor_parallel(rank, args.tp_size, init_method, resolve_device(args.device))
    if rank >= args.tp_size // args.nnodes:  # on another node than rank 0: node 0 watches its heartbeat
        start_beating(rank)
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
        if kind == "ping":  # rank 0 checking that the group is whole (TPGroupHandle.alive)
            continue
        if kind == "flush":
            worker.flush_cache()
        elif kind == "lora":  # rank 0 answers the frontend with its own result; the ranks load the same files
            try:
                worker.lora_adapter(msg[1], msg[2])
            except ValueError:
                logger.exception("tp rank %d: LoRA adapter %r", rank, msg[1])
        elif kind == "step":
            try:
                worker.execute(msg[1])
            except Exception:  # rank 0 fails the batch with the same error; keep following it
                logger.exception("tp rank %d: model step failed", rank)


def main() -> None:
    rank, init_method = sys.argv[1:3]
    settings = read_settings()
    logging.basicConfig(level="INFO", format=f"[%(asctime)s tp{rank}] %(message)s")
    exit_with_parent()
    rank_main(ServerArgs(**settings), int(rank), init_method)


if __name__ == "__main__":
    main()
