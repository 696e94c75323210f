"""`python -m tessera.entrypoints.scheduler_process IN OUT READY [DP_RANK]`: a scheduler replica's process,
started by the frontend (frontend/scheduler_procs.py, through platform/launch.py: settings on stdin).

It wires the pieces the scheduler is given: the other tensor-parallel ranks (started here first, so the group
exists before the model is sharded), rank 0's model worker, then the Scheduler; it reports ready (the
worker's settled settings) or the startup error to the frontend, and runs the loop.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import zmq

from tessera import messages
from tessera.config import ServerArgs
from tessera.platform.launch import child_setup, read_settings

STARTUP_ERROR_LINGER_S = 60  # how long a scheduler that failed to start waits for the frontend to take its error


def build_scheduler(args: ServerArgs, recv_endpoint: str, send_endpoint: str, dp_rank: int = 0):
    """The replica's ranks, worker and scheduler."""
    from tessera.distributed.tp_launch import TPGroupHandle
    from tessera.models.config import ModelConfig, eos_token_ids
    from tessera.models.transformers_family import refuse_backend_options
    from tessera.scheduler.scheduler import Scheduler
    from tessera.worker.model_worker import ModelWorker

    config = ModelConfig.load(args.model_path, args.model_impl)
    refuse_backend_options(config.family, args.enable_lora, args.tp_size)
    eos_ids = eos_token_ids(config)
    tp = TPGroupHandle(args) if args.tp_size > 1 else None
    worker = ModelWorker(args, eos_ids, config)
    return Scheduler(args, recv_endpoint, send_endpoint, worker, config, eos_ids, tp, dp_rank)


def run_scheduler_process(args: ServerArgs, recv_endpoint: str, send_endpoint: str, ready_endpoint: str,
                          dp_rank: int = 0) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s scheduler] %(message)s")
    import torch

    torch.manual_seed(args.random_seed)
    torch.set_num_threads(args.worker_threads)
    ready_ctx = zmq.Context()  # its own, so that term() below waits for this one message only
    ready = ready_ctx.socket(zmq.PUSH)
    ready.connect(ready_endpoint)
    try:
        scheduler = build_scheduler(args, recv_endpoint, send_endpoint, dp_rank)
    except Exception as e:  # report startup failures (bad checkpoint, ...) to the parent
        first_line = (str(e).strip().splitlines() or [""])[0]
        messages.send(ready, messages.SchedulerError(f"{type(e).__name__}: {first_line}", traceback.format_exc()))
        # The frontend may not have bound its end yet (it loads its processor meanwhile): wait, bounded,
        # until the message is out rather than exit with it still queued.
        ready.close(linger=int(STARTUP_ERROR_LINGER_S * 1000))
        ready_ctx.term()
        return
    messages.send(ready, messages.SchedulerReady(scheduler.worker.info))
    try:
        scheduler.run_forever()
    except SystemExit as e:
        # The replica stops itself (a tensor-parallel rank is gone): leave at once. The interpreter's teardown
        # (a broken process group, sockets lingering) took ~2.7 s, during which the server still said healthy.
        logging.shutdown()
        os._exit(e.code if isinstance(e.code, int) else 1)


def main() -> None:
    to_sched, from_sched, ready = sys.argv[1:4]
    dp_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    args = ServerArgs(**read_settings())
    if args.disable_tqdm:  # the weight-loading progress bar (models/weights.py)
        os.environ["TQDM_DISABLE"] = "1"
    child_setup()
    run_scheduler_process(args, to_sched, from_sched, ready, dp_rank)


if __name__ == "__main__":
    main()
