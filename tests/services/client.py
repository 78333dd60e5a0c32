"""A minimal gateway stand-in for the tests: Reserve -> Prefill -> Decode over real sockets."""
from __future__ import annotations

from common.convert import params_to_pb
from common.grpc_util import channel_options, open_channel
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


class Client:
    def __init__(self, prefill_addr: str, decode_addr: str, auth=None):
        """auth: common.auth.InternalAuth (the services' internal credentials) or None."""
        self._pc = open_channel(prefill_addr, auth, channel_options())
        self._dc = open_channel(decode_addr, auth, channel_options())
        self.prefill = prefill_pb2_grpc.PrefillStub(self._pc)
        self.decode = decode_pb2_grpc.DecodeStub(self._dc)

    async def close(self):
        await self._pc.close()
        await self._dc.close()

    async def start(self, rid: str, prompt: list[int], params, detokenize=False):
        """Reserve + Prefill; -> (ticket, prefill response, Decode call (not yet read))."""
        pp = params_to_pb(params)
        res = await self.decode.Reserve(decode_pb2.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
            max_tokens=params.max_tokens), timeout=10)
        pre = await self.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=pp, ticket=res.ticket), timeout=30)
        call = self.decode.Decode(decode_pb2.DecodeRequest(
            request_id=rid, transfer_id=res.ticket.transfer_id, prompt_token_ids=prompt,
            first_token_id=pre.first_token_id, params=pp, detokenize=detokenize), timeout=60)
        return res.ticket, pre, call

    async def generate(self, rid: str, prompt: list[int], params, detokenize=False):
        """-> (all token ids incl. the first, [DecodeResponse])"""
        _, pre, call = await self.start(rid, prompt, params, detokenize)
        toks, msgs = [pre.first_token_id], []
        async for m in call:
            toks += list(m.token_ids)
            msgs.append(m)
        return toks, msgs


async def take_tokens(call, n: int) -> int:
    """Read a Decode stream until it has delivered at least n tokens (or ended); -> count."""
    got = 0
    async for m in call:
        got += len(m.token_ids)
        if got >= n:
            break
    return got
