"""The Engine's disaggregation calls (a mixin of engine.engine.Engine; they use its request
table, scheduler, KV manager and runner).

Decode side: `reserve` blocks for an incoming prompt (`reserve_replacing` for a retried id;
given the prompt, its leading full blocks already in decode's prefix cache are pinned and not
sent), `import_kv` what prefill sent into the others (`reserved_block_ids` / `kv_cache_tensors` for a
backend that writes them in place), then `add_prefilled` joins the request to the running
batch with its first token; `release_if_owner` frees a reservation a newer one has not taken
over. Prefill side: run `prefill_only` requests, `export_kv` their blocks (or have them handed
out layer by layer during the forward: `stream_kv_layers`, engine/layer_stream.py), and
`release` them.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import torch

from engine.kv_blocks import DTYPE_NAMES, NAME_DTYPES, KVBlocks, raw_view
from engine.layer_stream import LayerExport
from engine.request import Request, RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams


class DisaggregationMixin:
    def reserve(self, request_id: str, num_prompt_tokens: int,
                prompt_token_ids: list[int] | None = None) -> list[int] | None:
        """Decode side: pre-allocate the blocks an incoming prompt's KV will land in. -> the
        blocks the transfer fills; blocks_for(num_prompt_tokens) minus their number leading
        blocks are prefix-cache hits (prompt_token_ids given), held and not to be sent."""
        if num_prompt_tokens < 1 or num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(f"cannot reserve for a prompt of {num_prompt_tokens} tokens "
                                      f"(max_model_len={self.max_model_len})")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        try:
            return self.kv.reserve(request_id, num_prompt_tokens, prompt_token_ids)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def reserve_replacing(self, request_id: str, num_prompt_tokens: int,
                          prompt_token_ids: list[int] | None = None) -> list[int] | None:
        """Decode side: `reserve`, first freeing the blocks an earlier, unclaimed reservation of
        the id still holds (a failed or replaced one). An id that is running raises."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.kv.block_ids(request_id):
            self.release(request_id)
        return self.reserve(request_id, num_prompt_tokens, prompt_token_ids)

    def reserved_block_ids(self, request_id: str) -> list[int]:
        """The blocks a transfer writes for `request_id`, in order (a copy; [] when none):
        all it holds, less a reservation's leading prefix-cache hits."""
        return self.kv.transfer_block_ids(request_id)

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The per-layer KV cache tensors; allocated once, they never move (a backend that
        writes blocks in place registers them)."""
        return self.runner.kv_caches

    def kv_pool(self):
        """The KV pool (engine.kv_memory.Pool): what a peer maps when it is shareable."""
        return self.runner.kv_pool

    def kv_block_view(self) -> torch.Tensor:
        """The KV pool as uint8 [num_layers * 2, num_blocks, block_bytes] (fixed after start)."""
        return self.runner.kv_block_view()

    def kv_scale_lists(self) -> tuple[list[float], list[float]] | None:
        """fp8 KV: the per-layer (k, v) scales; None for other KV dtypes."""
        sc = self.runner.kv_scales
        return (sc.k.tolist(), sc.v.tolist()) if sc is not None else None

    def release_if_owner(self, request_id: str, transfer_id: str, owner: Mapping[str, str]) -> bool:
        """Decode side: `release` unless `owner` (request id -> transfer id holding its
        reservation now) names another transfer: a newer reservation of the id took over.
        Read here, between steps, so the check and the free are one step. -> released?"""
        cur = owner.get(request_id)
        if cur is not None and cur != transfer_id:
            return False
        self.release(request_id)
        return True

    def publish_if_owner(self, request_id: str, transfer_id: str, owner: Mapping[str, str],
                         prompt_token_ids: list[int]) -> int:
        """Decode side: make an unclaimed reservation's full prompt blocks findable by later
        reservations, its KV having arrived whole (DONE) though no request will run on it (the
        first token ended it). Only while `owner` names this transfer: a newer reservation's
        blocks are not filled yet. -> blocks now registered."""
        if owner.get(request_id) != transfer_id or request_id in self.requests:
            return 0
        held = len(self.kv.block_ids(request_id))
        if not held or held != self.kv.blocks_for(len(prompt_token_ids)):
            return 0
        req = Request(request_id, list(prompt_token_ids), SamplingParams())
        req.num_computed_tokens = req.num_prompt_tokens
        before = len(self.kv.pool.cached)
        self.kv.cache_full_blocks(req)
        return len(self.kv.pool.cached) - before

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                      params: SamplingParams) -> RequestOutput | None:
        """Decode side: join a request whose prompt KV sits in its reserved blocks.
        Returns a finished output at once if the first token already ends it."""
        req = self._make_request(request_id, prompt_token_ids, params)
        if not self.kv.block_ids(request_id):
            raise InvalidRequestError(f"request {request_id!r} has no reserved KV blocks")
        req.num_computed_tokens = req.num_prompt_tokens
        # NOTE: the whole prompt's KV is in place now (the transfer is DONE): only from here
        # may its full blocks be found by later reservations
        self.kv.cache_full_blocks(req)
        req.output_token_ids.append(int(first_token_id))
        if req.grammar is not None and not req.grammar.accept(first_token_id):
            raise InvalidRequestError(f"first_token_id {first_token_id} is not allowed by the "
                                      "request's response_format")
        req.first_token_time = time.monotonic()
        reason = self._first_token_finish(req)
        if reason is not None:
            self.kv.free(request_id)
            return RequestOutput(request_id, [], True, reason, num_prompt_tokens=req.num_prompt_tokens)
        self.requests[request_id] = req
        self.scheduler.add_running(req)
        return None

    def _first_token_finish(self, req: Request) -> str | None:
        p = req.params
        tok = req.output_token_ids[-1]
        if req.grammar is not None and req.grammar.terminated:
            return "stop"
        if p.min_tokens <= 1 and ((not p.ignore_eos and tok in req.eos_token_ids)
                                  or tok in p.stop_token_ids):
            return "stop"
        if p.max_tokens <= 1 or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def stream_kv_layers(self, request_id: str, on_layer: Callable[[LayerExport], None],
                         skip_blocks: int = 0) -> None:
        """Prefill side: hand out `request_id`'s KV layer by layer (on_layer(LayerExport), on
        this thread, layer order) during the forward that completes its prompt, less its first
        `skip_blocks` blocks (decode holds them). Register before
        add_request(..., prefill_only=True); claims the id (a second registration, or one for
        an id in use, raises InvalidRequestError). Dropped by abort / release / the export."""
        if request_id in self.requests or request_id in self.layer_streamer.callbacks:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.layer_streamer.register(request_id, on_layer, skip_blocks)

    def export_kv(self, request_id: str, skip_blocks: int = 0) -> KVBlocks:
        """The request's prompt blocks from `skip_blocks` on, on the CPU."""
        req = self.requests.get(request_id)
        ids = self.kv.block_ids(request_id)
        if not ids:
            raise KeyError(f"no KV blocks held for request {request_id!r}")
        n_tokens = req.num_prompt_tokens if req is not None else len(ids) * self.cfg.cache.block_size
        n_blocks = -(-n_tokens // self.cfg.cache.block_size)
        if not 0 <= skip_blocks < n_blocks:
            raise ValueError(f"skip_blocks {skip_blocks} out of range [0, {n_blocks})")
        idx = torch.tensor(ids[skip_blocks:n_blocks], dtype=torch.long, device=self.device)
        # NOTE: index ops lack fp8 kernels on CPU; move raw bytes and view back
        dt = self.runner.kv_dtype
        layers = [kv.view(torch.uint8).index_select(1, idx).cpu().contiguous().view(dt)
                  for kv in self.runner.kv_caches]
        sc = self.runner.kv_scales
        return KVBlocks(self.cfg.cache.block_size, n_tokens, DTYPE_NAMES[self.runner.kv_dtype], layers,
                        sc.k.tolist() if sc else None, sc.v.tolist() if sc else None)

    def import_kv(self, request_id: str, blocks: KVBlocks, first_layer: int = 0) -> None:
        """Write received blocks (all layers, or layers from `first_layer` on) into the
        request's reserved blocks (those its transfer writes: reserved_block_ids)."""
        ids = self.kv.transfer_block_ids(request_id)
        if blocks.block_size != self.cfg.cache.block_size:
            raise ValueError(f"block size {blocks.block_size} != ours {self.cfg.cache.block_size}")
        if NAME_DTYPES[blocks.dtype] != self.runner.kv_dtype:
            raise ValueError(f"kv dtype {blocks.dtype} != ours {DTYPE_NAMES[self.runner.kv_dtype]}")
        if blocks.num_blocks > len(ids):
            raise ValueError(f"{blocks.num_blocks} blocks sent, {len(ids)} reserved")
        idx = torch.tensor(ids[:blocks.num_blocks], dtype=torch.long, device=self.device)
        for i, t in enumerate(blocks.layers):
            dst = raw_view(self.runner.kv_caches[first_layer + i])
            dst.index_copy_(1, idx, raw_view(t.to(self.device)))
        sc = self.runner.kv_scales
        if sc is not None and blocks.k_scales is not None:
            sc.k.copy_(torch.tensor(blocks.k_scales))
            sc.v.copy_(torch.tensor(blocks.v_scales))
            sc.calibrated = [True] * len(sc.calibrated)

    def release(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.layer_streamer.unregister(request_id)
        req = self.requests.get(request_id)
        if req is not None and (req.finished or req.prefill_only):
            self.requests.pop(request_id, None)
