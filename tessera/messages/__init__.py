"""The typed hand-offs between processes, at the ground floor: imported by the frontend, the scheduler and the
workers, importing none of them.

- items.py: media items and a request's multimodal inputs (what the processors produce);
- sampling.py: SamplingParams;
- finish.py: FinishReason, why a request ended (and its two wire shapes);
- frontend.py: frontend <-> scheduler (tokenized requests, aborts, stats, outputs, ready/error);
- worker.py: scheduler -> worker (ForwardInput) and back (StepOutput), the worker's startup report;
- codec.py: the one encoding every message crosses a process in.
"""

from tessera.messages.codec import decode, dumps, encode, loads, recv, recv_async, send, send_async
from tessera.messages.finish import FinishKind, FinishReason
from tessera.messages.frontend import (
    AbortReq,
    BatchOutput,
    FlushCacheReq,
    GetStatsReq,
    LoraAdapterReq,
    LoraAdapterResult,
    ReqOutput,
    SchedulerError,
    SchedulerReady,
    SchedulerStats,
    TokenizedBatchReq,
    TokenizedGenerateReq,
)

__all__ = ["AbortReq", "BatchOutput", "FinishKind", "FinishReason",
           "FlushCacheReq", "GetStatsReq", "LoraAdapterReq", "LoraAdapterResult", "ReqOutput", "SchedulerError",
           "SchedulerReady", "SchedulerStats", "TokenizedBatchReq", "TokenizedGenerateReq", "decode", "dumps", "encode", "loads", "recv",
           "recv_async", "send", "send_async"]
