"""Outbox: a single consumer's inbox on one event loop, for streams that put an item a token.

A list and one future a wake-up, not an asyncio.Queue: a queue's put/get pair costs about a
microsecond each on the loop, and at 64 streams that is paid thousands of times a second
(`python -m lab.decode_stream_probe --mode batched`). take() returns everything queued, so a
consumer that fell behind catches up in one wake-up.
"""
from __future__ import annotations

import asyncio


class Outbox:
    __slots__ = ("items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.items: list = []
        self._loop, self._waiter = loop, None

    def put(self, entry) -> None:
        self.items.append(entry)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list:
        """Wait for at least one entry; return all of them (oldest first)."""
        while not self.items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items
