"""common.outbox.Outbox: one consumer takes everything put since its last take, in order."""
import asyncio

import pytest


async def test_outbox_hands_the_writer_everything_put_since_its_last_take_in_order():
    from common.outbox import Outbox

    box = Outbox(asyncio.get_running_loop())
    box.put(1)
    box.put(None)
    assert await box.take() == [1, None]
    waiting = asyncio.ensure_future(box.take())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing put: the writer waits
    for x in ("a", "b", "c"):  # a step's entries, put before the writer runs again
        box.put(x)
    assert await asyncio.wait_for(waiting, 1) == ["a", "b", "c"]
    assert box.items == []
    waiting = asyncio.ensure_future(box.take())
    await asyncio.sleep(0)
    waiting.cancel()  # a cancelled writer leaves no waiter behind
    with pytest.raises(asyncio.CancelledError):
        await waiting
    box.put("d")
    assert await box.take() == ["d"]
