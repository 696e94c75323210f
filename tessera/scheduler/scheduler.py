"""The scheduler process: receives tokenized requests, runs the batching loop, emits tokens.

Loop: drain incoming messages -> form a batch (policy) -> model step (runner) -> append
sampled tokens, check stop conditions -> send incremental outputs -> release finished KV.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import zmq

from tessera import messages
from tessera.config import ServerArgs
from tessera.constrained.matcher import GrammarCompiler
from tessera.messages.finish import FinishReason
from tessera.messages.items import Modality
from tessera.messages.worker import ForwardInput, StepOutput
from tessera.models.config import ModelConfig
from tessera.platform.device import platform_of
from tessera.platform.threads import AdaptiveThreads, available_cores
from tessera.scheduler.lora_slots import LoraSlotTable, handle_lora_adapter
from tessera.scheduler.overlap import Launched, Overlap
from tessera.scheduler.req import Req
from tessera.scheduler.speculative import accepted_prefix, make_speculator
from tessera.scheduler.step_input import build_forward_input, take_prompt_logprobs
from tessera.scheduler.stops import check_finished
from tessera.scheduler.summary import PeriodicSummary
from tessera.scheduler.worker_api import RankGroup, StepWorker  # noqa: F401 -- StepWorker re-exported

logger = logging.getLogger("tessera.scheduler")
# While requests are held (media encoded ahead, a grammar compiling), the loop waits this long for a message
# before a step: see Scheduler.poll_timeout_ms.
HELD_POLL_MS = 2


class Scheduler:
    """Owns the request table, the page allocator, the radix tree and the cache keys; each step it hands a
    ForwardInput to the model worker and applies the sampled tokens it returns.

    The worker (rank 0's, in this process) and the handle of the other TP ranks are given: the scheduler
    knows them only through `worker.info`, `worker.launch(ForwardInput)` / `collect(handle) -> StepOutput`, its
    cache calls and `tp.broadcast(message)` (scheduler/worker_api.py; entrypoints/scheduler_process.py builds
    them)."""

    def __init__(self, args: ServerArgs, recv_endpoint: str, send_endpoint: str, worker: StepWorker,
                 config: ModelConfig, eos_ids: set[int], tp: RankGroup | None = None, dp_rank: int = 0):
        from transformers import AutoTokenizer

        from tessera.cache.allocator import PagedTokenAllocator
        from tessera.cache.kv_pool import ReqToTokenPool
        from tessera.cache.radix_cache import RadixCache
        from tessera.scheduler.kv_manager import KVManager, state_slots
        from tessera.scheduler.policy import SchedulePolicy

        self.args = args
        self.dp_rank = dp_rank
        ctx = zmq.Context.instance()
        self.recv_sock = ctx.socket(zmq.PULL)
        self.recv_sock.connect(recv_endpoint)
        self.send_sock = ctx.socket(zmq.PUSH)
        self.send_sock.connect(send_endpoint)

        self.config = config
        self.model_cls = self.config.family.model_class()
        self.eos_ids = eos_ids
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.tp = tp
        self.worker = worker
        info = self.worker.info
        self.context_length = info.context_length
        # Scheduler-side KV bookkeeping lives on the host: the worker's device copy of the slot table is
        # kept in step by the ForwardInput's slot writes, so nothing here reads a device tensor.
        req_pool = ReqToTokenPool(args.max_running_requests + 1, info.context_length + 8)
        allocator = PagedTokenAllocator(info.max_total_tokens, args.page_size)
        prefix_cache = self.config.family.prefix_cache and not args.disable_radix_cache
        # Hybrid models match a prefix only up to a state snapshot (scheduler/state_snapshots.py).
        snapshots, verify = state_slots(self.config.family.linear_attention, info.state_snapshot_slots, args)
        self.tree = RadixCache(allocator, args.page_size, disable=not prefix_cache, snapshots=snapshots)
        state = self.model_cls.request_state
        kv = KVManager(req_pool, allocator, self.tree, args.page_size, None if state is None else (
            lambda req: state.extra_slots(self.config, req.mm_inputs.items if req.mm_inputs else [])), verify)
        self.speculator = make_speculator(args, info.context_length, getattr(self.worker, "draft_proposer", None))
        self.policy = SchedulePolicy(kv, args.max_running_requests, args.chunked_prefill_size, args.schedule_policy,
                                     self.speculator, args.max_prefill_tokens)
        # Which adapter is in which of the worker's LoRA slots (None without --enable-lora).
        self.lora_slots = self.policy.lora_slots = (LoraSlotTable(args.max_loras_per_batch, dict(args.lora_adapters))
                                                    if args.enable_lora else None)
        self.reqs: dict[str, Req] = {}
        # Threads per step on a CPU (see platform/threads.py); None: the fixed count set at process start.
        self.threads: AdaptiveThreads | None = None
        if not platform_of(self.worker.device).runs_on_host_cores:
            self.worker.start_encode_ahead()  # media encoded on a side stream while the steps run
        elif args.adaptive_threads:
            # Media are encoded ahead on a core the policy leaves to that thread while it has work.
            reserved = self.worker.background_cores if self.worker.start_encode_ahead() else None
            self.threads = AdaptiveThreads(available_cores(), reserved=reserved)
            self.worker.between_phases = self.threads.before_step
        # Constrained requests' grammars compile off the loop (held until ready, see _admit_ready).
        self.grammars = GrammarCompiler(self.tokenizer, info.vocab_size, self.eos_ids)
        # Requests not yet in the policy's queue: a grammar compiling (the future) or media being encoded ahead.
        self.held: dict[str, tuple[Req, Future | None]] = {}
        self.num_forward_steps = 0
        self.num_steps_all_cores = 0
        self.num_prefill_tokens_computed = 0
        self.num_output_tokens = 0
        self.num_embedding_requests = 0
        self.summary = PeriodicSummary(dp_rank=dp_rank)
        self.mm_transport_bytes = {m.value: 0 for m in Modality}
        self.mm_items = {"deferred": 0, "eager": 0}
        # Forms decode step N+1 while the device runs step N (scheduler/overlap.py); speculative steps need the
        # tokens on the host before the next one.
        self.overlap = Overlap(self.policy, self.launch, self.finish_step, self.context_length, self.model_cls) \
            if args.overlap_schedule and self.speculator is None else None
        if args.overlap_schedule and self.overlap is None:
            logger.info("overlap scheduling is off: speculative decoding verifies each step's tokens on the host")

    # ---- messages -----------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, messages.TokenizedGenerateReq):
            sp = msg.sampling_params
            req = Req(msg.rid, msg.input_ids, sp, msg.mm_inputs, msg.stream, msg.return_logprob,
                      cache_salt=msg.cache_salt, logprob_start_len=msg.logprob_start_len,
                      prompt_logprob_ranks=msg.prompt_logprob_ranks, lora_name=msg.lora_name)
            req.pooling = msg.pooling
            if req.wants_input_logprobs:
                n = len(req.origin_input_ids) - req.logprob_start_len
                req.input_logprobs, req.input_top_logprobs, req.input_ranks = [None] * n, [None] * n, [None] * n
            for item in msg.mm_inputs.items if msg.mm_inputs is not None else ():
                self.mm_transport_bytes[item.modality.value] += item.transport_bytes
                self.mm_items["deferred" if item.deferred is not None else "eager"] += 1
            if self.config.family.bidirectional_mm_spans and msg.mm_inputs is not None:
                req.atomic_spans = msg.mm_inputs.spans()
            if self.config.family.embedding_only or self.config.family.prefix_lm:  # a dual encoder's request, a
                req.atomic_spans = [(0, len(req.origin_input_ids))]  # prefix LM's prompt: computed in one step
            req.stop_token_ids = sp.stop_ids(self.eos_ids)
            if req.lora_name is not None and (self.lora_slots is None or req.lora_name not in self.lora_slots.loaded):
                # Unloaded between the frontend's check and now: this request fails, not the batch it would join.
                unloaded = FinishReason.error(f"lora_path: adapter {req.lora_name!r} is not loaded")
                self._emit([self._output(req, unloaded)])
                return
            if sp.max_new_tokens == 0 and not req.wants_input_logprobs and req.pooling is None:  # a prefill, no token
                self._emit([self._output(req, FinishReason.of_length(0))])
                return
            self.reqs[req.rid] = req
            items = msg.mm_inputs.items if msg.mm_inputs is not None else []
            if items:
                self.worker.encode_ahead(items)
            grammar = self.grammars.submit(*sp.constraint) if sp.constraint is not None else None
            if grammar is None and self.worker.media_ready(items):
                self.policy.add(req)
            else:
                self.held[req.rid] = (req, grammar)
                self._admit_ready()
        elif isinstance(msg, messages.TokenizedBatchReq):
            for one in msg.reqs:
                self.handle(one)
        elif isinstance(msg, messages.AbortReq):
            req = self.reqs.pop(msg.rid, None)
            if req is not None:
                held = self.held.pop(msg.rid, None)
                if held is None:  # overlap: a step in flight holds a row of it; its KV goes back after that step
                    if self.overlap is None or not self.overlap.release_later(req, finished=False):
                        self.policy.remove(req)
                elif held[1] is not None:
                    held[1].cancel()
                req.finished_reason = FinishReason.abort()
                self._emit([self._output(req, req.finished_reason)])
        elif isinstance(msg, messages.FlushCacheReq):
            if self.overlap is not None:
                self.overlap.drain()  # its finished requests' KV goes back to the tree before the reset
            if not self.reqs:
                self.tree.reset()
                if self.tp is not None:
                    self.tp.broadcast(("flush",))
                self.worker.flush_cache()
        elif isinstance(msg, messages.GetStatsReq):
            messages.send(self.send_sock, self.stats())
        elif isinstance(msg, messages.LoraAdapterReq):
            messages.send(self.send_sock, handle_lora_adapter(msg, self.reqs.values(), self._apply_lora,
                                                              self.lora_slots, self.dp_rank))
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    def _apply_lora(self, name: str, path: str | None) -> None:
        """Loads adapter `name` from `path` (None: unloads it) on every rank of this replica."""
        if self.tp is not None:
            self.tp.broadcast(("lora", name, path))
        self.worker.lora_adapter(name, path)

    def _admit_ready(self) -> None:
        """Held requests join the policy's queue once their grammar's matcher is built and their media are
        encoded ahead (worker/encode_ahead.py: the admitting step then has only the language model to run). A
        grammar that failed to build fails its request (the frontend checked it, so this is a
        tokenizer-specific problem)."""
        # With nothing to run, the oldest request is not held for its media: its step encodes what the
        # encode-ahead thread has not started, beside that thread, instead of the loop idling.
        idle = not (self.policy.running or self.policy.waiting)
        for rid, (req, grammar) in list(self.held.items()):
            if grammar is not None and not grammar.done():
                continue
            if not idle and not self.worker.media_ready(req.mm_inputs.items if req.mm_inputs is not None else []):
                continue
            idle = False
            del self.held[rid]
            if grammar is not None:
                try:
                    req.grammar = grammar.result()
                except Exception as e:
                    self.reqs.pop(rid, None)
                    req.finished_reason = FinishReason.error(f"{type(e).__name__}: {e}")
                    self._emit([self._output(req, req.finished_reason)])
                    continue
            self.policy.add(req)

    def stats(self) -> messages.SchedulerStats:
        kv = self.policy.kv
        total = kv.allocator.num_pages * kv.allocator.page_size
        hits, misses, used = self.worker.cache_stats()
        busy_s, idle_s = self.worker.device_times()
        spec = self.speculator
        return messages.SchedulerStats(
            num_running=len(self.policy.running), num_waiting=len(self.policy.waiting) + len(self.held),
            kv_used_tokens=total - kv.allocator.num_free_tokens - self.tree.evictable_size(),
            kv_total_tokens=total, radix_cache_tokens=self.tree.total_size(),
            prefix_hit_tokens=kv.prefix_hit_tokens, prefix_total_tokens=kv.prefix_total_tokens,
            encoder_cache_hits=hits, encoder_cache_misses=misses,
            encoder_cache_bytes=used, cross_kv_used_tokens=kv.state_tokens, num_forward_steps=self.num_forward_steps,
            num_prefill_tokens_computed=self.num_prefill_tokens_computed,
            num_retractions=self.policy.num_retractions, num_steps_all_cores=self.num_steps_all_cores,
            dp_rank=self.dp_rank, mm_transport_bytes=dict(self.mm_transport_bytes),
            mm_transport_bytes_total=sum(self.mm_transport_bytes.values()),
            mm_deferred_items=self.mm_items["deferred"], mm_eager_items=self.mm_items["eager"],
            device_busy_s=busy_s, device_idle_s=idle_s, num_embedding_requests=self.num_embedding_requests,
            spec_verifies=spec.num_verifies if spec else 0, spec_draft_tokens=spec.num_drafted if spec else 0,
            spec_accepted_tokens=spec.num_accepted if spec else 0, state_snapshots=self.tree.num_states(),
        )

    # ---- stepping -------------------------------------------------------------------------
    def _output(self, req: Req, finished: FinishReason | None = None) -> messages.ReqOutput:
        new = req.output_ids[req.num_sent :]
        out = messages.ReqOutput(
            rid=req.rid, new_token_ids=new, finished_reason=finished,
            prompt_tokens=len(req.origin_input_ids), cached_tokens=req.cached_len,
            completion_tokens=len(req.output_ids), spec_verify_ct=req.spec_verify_ct,
            spec_accepted_tokens=req.spec_accepted,
        )
        if req.return_logprob:
            out.new_logprobs = req.logprobs[req.num_sent :]
            out.new_top_logprobs = req.top_logprobs[req.num_sent :] or None
        if req.input_logprobs_done and not req.input_logprobs_sent:
            req.input_logprobs_sent = True
            ids = req.origin_input_ids[req.logprob_start_len:]
            out.input_token_logprobs = list(zip(req.input_logprobs, ids))
            if req.prompt_logprob_ranks:
                out.input_token_ranks = list(req.input_ranks)
            if req.sampling_params.top_logprobs_num:
                out.input_top_logprobs = [None if top is None else [(lp, tid) for tid, lp in top]
                                          for top in req.input_top_logprobs]
        req.num_sent = len(req.output_ids)
        return out

    def _emit(self, outputs: list[messages.ReqOutput]) -> None:
        if outputs:
            messages.send(self.send_sock, messages.BatchOutput(outputs))

    def _check_finished(self, req: Req) -> FinishReason | None:
        return check_finished(req, self.tokenizer, self.context_length)

    def step(self) -> bool:
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.policy.next_batch()
        if batch is None:
            return False
        step = self.launch(batch)
        if step is not None:
            self.finish_step(step)
        return True

    def launch(self, batch, pending: list[int] | None = None) -> Launched | None:
        """Hands the step to the worker; None when it failed, which fails its batch. pending: the overlap's
        placeholders for tokens the step in flight is sampling (build_forward_input)."""
        try:
            fi = build_forward_input(batch, self.model_cls, self.config, self.policy.kv, pending)
            if self.lora_slots is not None:
                self.lora_slots.fill(fi, batch)
            if self.tp is not None:  # every rank runs the same step; rank 0 (here) samples
                self.tp.broadcast(("step", fi))
            if self.threads is not None and self.threads.before_step() == self.threads.cores:
                self.num_steps_all_cores += 1
            return Launched(batch, fi, self.worker.launch(fi))
        except Exception as e:  # a bug or a bad tensor that got past the frontend: fail this batch only
            self._step_failed(batch, e)
            return None

    def finish_step(self, step: Launched) -> None:
        """Reads a launched step's tokens and applies them: appends, stop checks, outputs, finished KV back."""
        try:
            result = self.worker.collect(step.handle)
        except Exception as e:
            self._step_failed(step.batch, e)
            return
        batch, fi = step.batch, step.fi
        self.num_forward_steps += 1
        for s in batch.reqs:
            if s.is_prefill:
                self.num_prefill_tokens_computed += s.end - s.start
                # An embedding request whose prompt ends here finishes below: its KV is cached once, then.
                if not self.tree.disable and not (s.req.pooling is not None and s.end == s.req.seq_len):
                    self.policy.kv.cache_prefill(s.req)
        take_prompt_logprobs(batch, fi, result)
        outputs = self._finish_pooled(batch, fi, result)
        row = 0  # the request's first sampled row in the step's output
        for s in batch.reqs:
            if not s.samples:
                continue
            req, rows = s.req, 1 + len(s.draft)
            if req.finished:  # overlap: finished (or aborted) while this step ran; its token is discarded
                pass
            elif req.sampling_params.max_new_tokens == 0:  # ran for its prompt logprobs only
                req.finished_reason = FinishReason.of_length(0)
                self._finish(req, req.finished_reason, outputs)
            else:
                tokens = result.next_token_ids[row:row + rows]
                if s.draft:
                    tokens = self._verified(s, tokens)
                for i, token in enumerate(tokens):
                    if self._append_token(req, token, result, row + i, outputs):
                        break
                else:
                    if req.stream and len(req.output_ids) - req.num_sent >= self.args.stream_interval:
                        outputs.append(self._output(req))
            row += rows
        self._emit(outputs)

    def _step_failed(self, batch, e: Exception) -> None:
        logger.error("model step failed; failing the %d requests of the batch", len(batch.reqs), exc_info=e)
        self._fail(batch, f"internal error in the model step: {type(e).__name__}: {e}")
        if self.tp is not None and not self.tp.alive:
            # A tensor-parallel rank died: this replica cannot step again. Exit, so the frontend takes
            # the replica out and fails its requests (or stops, when it was the only one).
            logger.error("a tensor-parallel rank exited; stopping this replica")
            raise SystemExit(1) from e

    def _verified(self, s, sampled: list[int]) -> list[int]:
        """A verify step's tokens to emit: the sampled rows up to the first that differs from its draft (see
        scheduler/speculative.py); the rejected drafts' KV slots go back."""
        accepted = accepted_prefix(s.draft, sampled)
        self.speculator.record(s.req.rid, len(s.draft), accepted)  # type: ignore[union-attr]
        s.req.spec_verify_ct += 1
        s.req.spec_accepted += accepted
        self.policy.kv.keep_drafts(s, accepted)
        return sampled[:accepted + 1]

    def _append_token(self, req: Req, token: int, result: StepOutput, row: int, outputs: list) -> bool:
        """Appends one sampled token to req's output and checks its stop conditions; True when it finished."""
        self.num_output_tokens += 1
        req.output_ids.append(token)
        if req.grammar is not None and not req.grammar.accept(token):
            # Cannot happen while the sampler applies the mask; fail loudly rather than emit invalid output.
            self._finish(req, FinishReason.error(f"constrained decoding: token {token} rejected by the grammar "
                                                f"({req.grammar.error})"), outputs)
            return True
        if req.return_logprob:
            req.logprobs.append(result.logprobs[row])  # type: ignore[index]
            # Only a request that asked: the others' [] entries would depend on which batch they shared.
            if result.top_logprobs is not None and req.sampling_params.top_logprobs_num:
                req.top_logprobs.append(result.top_logprobs[row])
        finished = self._check_finished(req)
        if finished is not None:
            self._finish(req, finished, outputs)
            return True
        return False

    def _finish(self, req: Req, finished: FinishReason, outputs: list) -> None:
        """Ends req: its KV goes back (a verify step that finished before its last accepted token holds KV past
        its last token: those slots too) and its final output joins `outputs`."""
        req.finished_reason = finished
        if self.overlap is None or not self.overlap.release_later(req, finished=True):
            held = req.kv_len
            req.kv_len = min(req.kv_len, req.seq_len)
            self.policy.finish(req, allocated_len=held)
        self.reqs.pop(req.rid, None)
        outputs.append(self._output(req, finished))
    def _finish_pooled(self, batch, fi: ForwardInput, result: StepOutput) -> list[messages.ReqOutput]:
        """Embedding requests whose prompt ended in the step finish with their pooled vector (their KV goes
        to the radix cache, as a finished request's)."""
        outputs, done = [], []
        of_rid = {s.req.rid: s.req for s in batch.reqs}
        for entry, vector in zip([e for e in fi.pooling_rows if e.final], result.embeddings):
            req = of_rid[fi.rids[entry.req]]  # entry.req: its row of fi (a verify step's rows come first)
            req.finished_reason = FinishReason.stop()
            done.append(req)
            self.reqs.pop(req.rid, None)
            outputs.append(self._output(req, req.finished_reason))
            outputs[-1].embedding = vector
        self.policy.finish_all(done)
        self.num_embedding_requests += len(done)
        return outputs

    def _fail(self, batch, message: str) -> None:
        outputs = []
        for s in batch.reqs:
            req = s.req
            self.policy.kv.drop_step(s)
            if req.finished:  # overlap: already answered while the step ran
                continue
            # The failed step wrote no usable KV; its fresh slots are freed (and those of a step launched after it).
            held, req.kv_len = max(s.end, req.kv_len), s.start
            req.finished_reason = FinishReason.error(message)
            self.policy.finish(req, allocated_len=held)
            self.reqs.pop(req.rid, None)
            outputs.append(self._output(req, req.finished_reason))
        self._emit(outputs)

    def poll_timeout_ms(self) -> int:
        """How long the loop waits for a message before its next step.

        Idle: 1 s, or HELD_POLL_MS while requests are held (a grammar compiling, media encoded ahead: neither
        thread has a socket to wake the loop). Busy: no wait, except on host cores under the adaptive thread
        policy while requests are held and none is queued: then the loop also waits HELD_POLL_MS before each
        step. A step's decode rows would otherwise take the cores that the encode-ahead thread and the frontend
        need to get the held requests to their first token; demo-vl on 2 cores, 256 requests at concurrency
        16, four alternations: 2,103-2,618 output tok/s against 1,897-2,152, TTFT p99 316-419 ms against
        379-533 (docs/benchmarks.md, "Yielding to the encoder")."""
        if self.overlap is not None and self.overlap.inflight is not None:
            return 0  # the step in flight is collected (its finished requests' KV released) at once
        if not (self.policy.running or self.policy.waiting):
            return HELD_POLL_MS if self.held else 1000
        if self.held and not self.policy.waiting and self.threads is not None:
            return HELD_POLL_MS
        return 0

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        while True:
            busy = bool(self.policy.running or self.policy.waiting)
            events = dict(poller.poll(self.poll_timeout_ms()))
            while events:
                self.handle(messages.recv(self.recv_sock))
                events = dict(poller.poll(0))
            if self.held:
                self._admit_ready()
            if not self.step():
                self.worker.idle()
            self.summary.tick(self.stats, self.num_output_tokens, busy)

