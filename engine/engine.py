"""Engine: the synchronous core both services run (on their engine thread).

add_request -> scheduler queues -> step() runs one batch through the ModelRunner -> outputs.
The disaggregation calls (reserve / import_kv / add_prefilled on the decode side,
stream_kv_layers / export_kv / release on the prefill side) are engine/disaggregation.py's
mixin.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.config import EngineConfig
from engine.disaggregation import DisaggregationMixin
from engine.kv_blocks import DTYPE_NAMES
from engine.kv_cache import KVCacheManager
from engine.layer_stream import LayerStreamer
from engine.layers.attention_select import get_attention_backend
from engine.loader import load_model
from engine.models.llama import CausalLM
from engine.overlap import Launched, TokenReadback, can_overlap, follow, plan_follow
from engine.request import Request, RequestOutput
from engine.runner import ModelRunner, StepInput, resolve_dtype
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler
from engine.structured import GrammarBackend

log = logging.getLogger("splitserve.engine")


class Engine(DisaggregationMixin):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        t0 = time.perf_counter()
        device = cfg.device.resolved_device()
        dtype = resolve_dtype(cfg.model.dtype, device)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if cfg.device.cpu_threads:
            torch.set_num_threads(cfg.device.cpu_threads)
        torch.manual_seed(cfg.model.seed)
        loaded = load_model(cfg.model, device, dtype)
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.model_name = cfg.model.served_model_name or loaded.name
        a = self.arch
        self.attn_backend = get_attention_backend(cfg.device.attention_backend, device,
                                                  a.num_heads, a.num_kv_heads, a.head_dim,
                                                  cpu_kernels=cfg.device.cpu_kernels)
        with torch.device(device):
            model = CausalLM(a, self.attn_backend, dtype=dtype)
        model.load_weights(loaded.weights)
        model.to(device=device, dtype=dtype).eval()
        self.device = device
        self.dtype = dtype
        self.max_model_len = cfg.model.max_model_len or a.max_position_embeddings
        self.runner = ModelRunner(cfg, model, a, device, dtype)
        nb = self.runner.plan_num_blocks(self.max_model_len)
        self.runner.allocate_kv(nb)
        self.runner.maybe_capture_graphs(self.max_model_len, self.attn_backend.name)
        model.layer_hook = None  # set around a forward that streams KV layers out
        self.layer_streamer = LayerStreamer(self.runner.kv_caches, self.runner.kv_scales, device)
        self.kv = KVCacheManager(nb, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.max_model_len)
        eos = set(a.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self.grammars = GrammarBackend(self.tokenizer, a.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_generated = 0
        # overlapped decode (engine/overlap.py): on by default where it overlaps (CUDA)
        ov = cfg.scheduler.async_scheduling
        self.overlap = (device.startswith("cuda")) if ov is None else bool(ov)
        self._readback = TokenReadback(cfg.scheduler.max_num_seqs, torch.device(device))
        self._inflight: Launched | None = None
        self._seq = 0
        self._last_done = 0.0  # when the last step's tokens were seen on the host
        self.num_overlapped_steps = 0
        log.info("engine ready: model=%s device=%s dtype=%s attention=%s blocks=%d load=%.1fs",
                 self.model_name, device, str(dtype).removeprefix("torch."), self.attn_backend.name,
                 nb, time.perf_counter() - t0)

    # ---- requests -------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, which leaves no room in max_model_len={self.max_model_len}")
        v = self.arch.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= v]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {v})")
        if -(-(n + 1) // self.cfg.cache.block_size) > self.kv.num_blocks:
            raise InvalidRequestError(f"prompt of {n} tokens needs more KV blocks than the cache "
                                      f"holds ({self.kv.num_blocks})")

    def _make_request(self, request_id, prompt_token_ids, params) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        if params.guided is not None:
            req.grammar = self.grammars.state(params.guided)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False) -> None:
        if prefill_only:
            params = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        req = self._make_request(request_id, prompt_token_ids, params)
        req.prefill_only = prefill_only
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.kv.free(request_id)
        self.requests.pop(request_id, None)
        self.layer_streamer.unregister(request_id)

    def has_unfinished(self) -> bool:
        # a step still in flight must be completed (its blocks released) even when every
        # request in it has ended
        return self._inflight is not None or any(not r.finished for r in self.requests.values())

    # ---- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step's outputs. With overlapped decode (engine/overlap.py) the step after
        it may already be on the device when this returns."""
        cur, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        if cur is None:
            sched = self.scheduler.schedule()
            outputs += self._failed(sched)
            if not sched.scheduled:
                return outputs
            cur = self._launch(sched)
        plan = plan_follow(cur, self.scheduler) if self.overlap else None
        if plan is not None:
            nxt, rows, tokens, pos = follow(cur, plan, self.scheduler, self._next_seq(),
                                            self.runner.sampling_batch)
            outputs += self._failed(nxt.sched)
            self._launch_overlapped(nxt, rows, token_src=tokens, token_pos=pos)
            self._inflight = nxt
            self.num_overlapped_steps += 1
        outputs += self._complete(cur)
        return outputs

    def _failed(self, sched) -> list[RequestOutput]:
        """Error outputs of the waiting requests a schedule dropped (they can never run)."""
        return [self._finish_error(req, getattr(req, "error", None) or "request cannot fit in the KV cache")
                for req in getattr(sched, "failed", []) or []]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _launch(self, sched) -> Launched:
        rows, sample_reqs = [], []
        for s in sched.scheduled:
            r = s.req
            rows.append(StepInput.of_request(r, r.num_computed_tokens, s.num_tokens,
                                             self.kv.block_ids(r.request_id), s.sample))
            if s.sample:
                sample_reqs.append(r)
        batch = self.runner.sampling_batch(sample_reqs) if sample_reqs else None
        launched = Launched(sched, sample_reqs, batch, self._next_seq())
        # the sampled tokens stay on the device so the next step may follow before they reach
        # the host (can_overlap: no layer streaming; rows with an earlier chunk of a prompt
        # sample nothing, and a step of such chunks only samples nothing at all: the next chunk
        # may still be launched before it ends)
        if self.overlap and can_overlap(sched):
            self._launch_overlapped(launched, rows)
            return launched
        streamed = [(s.req.request_id, rows[i].block_ids, s.req.num_prompt_tokens)
                    for i, s in enumerate(sched.scheduled)
                    if s.sample and s.req.prefill_only and s.req.request_id in self.layer_streamer.callbacks]
        hook = self.layer_streamer.begin_step(streamed) if streamed else None
        self.runner.model.layer_hook = hook
        try:
            launched.out, _ = self.runner.execute(rows, batch)
        finally:
            self.runner.model.layer_hook = None
        if hook is not None:
            self.layer_streamer.end_step()
        return launched

    def _launch_overlapped(self, launched: Launched, rows, token_src=None, token_pos=None) -> None:
        """An overlapped step (decode rows, prompt chunks): run and sample on the device, start
        the tokens' copy to the host; blocks freed from now on wait until this step is known
        complete. token_src / token_pos: decode rows' input ids on the device (follow)."""
        launched.tokens, launched.logprobs = self.runner.launch_overlapped(
            rows, launched.batch, token_src, token_pos)
        self._readback.start(launched)
        self.kv.fence = launched.seq

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens; update the scheduler; its outputs."""
        out = launched.result()
        if launched.overlapped:
            # launched while the step before it still ran: it starts when that one ended.
            # (launch-to-done would count both, and the gateway's admission reads these as
            # the time per token: Load's mean_step_ms)
            self.runner.record_step_time(max(launched.t0, self._last_done))
            # every step up to this one has completed on the device
            self.kv.release_deferred(launched.seq)
            if self._inflight is None:
                self.kv.fence = 0
        sample_reqs = launched.sample_reqs
        # requests that ended while the step was in flight (abort, a stop string, or a stop
        # on the previous step's token): their row was computed blindly; no output
        live = {r.request_id for r in sample_reqs if not r.finished}
        sampled: dict[str, int] = {}
        if out is not None:
            for r, tok, lp in zip(sample_reqs, out.token_ids, out.logprobs):
                if r.request_id not in live:
                    continue
                sampled[r.request_id] = tok
                if r.params.logprobs is not None:
                    r.output_logprobs.append(lp)
                if r.first_token_time is None:
                    r.first_token_time = time.monotonic()
        self._last_done = time.perf_counter()
        finished = {r.request_id for r in self.scheduler.update(launched.sched, sampled)}
        self.num_steps += 1
        self.num_generated += len(sampled)
        outputs = []
        for r in sample_reqs:
            rid = r.request_id
            if rid not in live:
                continue
            done = rid in finished or r.finished
            lps = [r.output_logprobs[-1]] if r.params.logprobs is not None else []
            first = len(r.output_token_ids) == 1 and r.scheduled_time is not None
            if not done and not first:  # most rows of a step: a running request's next token
                # NOTE: positional (half the cost of keywords, once a row a step): request_id,
                # new_token_ids, finished, finish_reason, logprobs, num_prompt_tokens,
                # num_cached_tokens
                outputs.append(RequestOutput(rid, [sampled[rid]], False, None, lps,
                                             len(r.prompt_token_ids), r.num_cached_tokens))
                continue
            outputs.append(RequestOutput(
                rid, [sampled[rid]], finished=done,
                finish_reason=r.status.value if done else None, logprobs=lps,
                num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens,
                block_ids=self.kv.block_ids(rid) if done and r.prefill_only else None,
                queue_s=r.scheduled_time - r.arrival_time if first else None,
                prefill_s=r.first_token_time - r.scheduled_time if first else None))
            if done and not r.prefill_only:
                self.requests.pop(rid, None)
        return outputs

    def _finish_error(self, req: Request, msg: str) -> RequestOutput:
        self.scheduler.abort(req.request_id)
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self.layer_streamer.unregister(req.request_id)
        return RequestOutput(req.request_id, [], True, "error", error=msg,
                             num_prompt_tokens=req.num_prompt_tokens)

    def generate(self, prompts: list[list[int]], params: SamplingParams, id_prefix: str = "gen-"
                 ) -> list[list[int]]:
        """Offline convenience: run `prompts` to completion together (continuous batching),
        return each one's generated token ids in order."""
        ids = [f"{id_prefix}{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.add_request(rid, p, params)
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for o in self.step():
                if o.request_id in got:
                    got[o.request_id].extend(o.new_token_ids)
        while self._inflight is not None:  # a blind step after the last stop: complete it
            self.step()
        return [got[rid] for rid in ids]

    # ---- introspection --------------------------------------------------------------
    def info(self) -> dict:
        a = self.arch
        return {
            "model": self.model_name, "arch": a.arch, "vocab_size": a.vocab_size,
            "max_model_len": self.max_model_len, "num_layers": a.num_layers,
            "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
            "block_size": self.cfg.cache.block_size, "num_blocks": self.kv.num_blocks,
            "kv_dtype": DTYPE_NAMES[self.runner.kv_dtype], "dtype": DTYPE_NAMES[self.dtype],
            "device": self.device, "attention_backend": self.attn_backend.name,
            "cuda_graphs": self.runner.graph_metrics() or None,
        }

    def stats(self) -> dict:
        st = self.runner.step_times
        kvs = self.kv.stats()
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "max_num_seqs": self.cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.cfg.scheduler.max_num_batched_tokens,
            "kv_usage": self.kv.usage, "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.kv.num_blocks,
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting),
            "recent_step_ms": [round(t * 1e3, 3) for t in st[-16:]],
            "num_steps": self.num_steps, "num_generated_tokens": self.num_generated,
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            **kvs,
            **self.runner.graph_metrics(),
        }
