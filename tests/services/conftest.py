"""Shared fixtures of the service tests: `client` talks to the module's `services` pair
(a fixture each module defines: (prefill Proc, decode Proc))."""
import pytest

from tests.services.client import Client


@pytest.fixture
async def client(services):
    pre, dec = services
    c = Client(pre.address, dec.address)
    yield c
    await c.close()
