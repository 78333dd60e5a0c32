"""What a ServiceMetrics registry exposes: the series groups of each role (EXPORTS), and the
served model's name as a `model_name` label on every sample (as vLLM labels its series), added
at scrape time so no call site names it."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# the series groups each role exports (a role not listed, e.g. a unit test's, exports all):
# request: outcomes, queue time, running / waiting   latency: TTFT, TPOT, e2e   itl: token gaps
# prompt / generation: token counters and per-request length histograms   prefill / decode: the
# phase's time per request   engine: scheduler, KV cache, steps, graphs   kv: KV transfer
# gateway: admission, routing, replicas as polled
EXPORTS = {
    "gateway": frozenset({"request", "latency", "itl", "prompt", "generation", "gateway"}),
    "prefill": frozenset({"request", "prompt", "prefill", "engine", "kv"}),
    # prompt / prefill: requests prefilled on decode itself (prefill_here)
    "decode": frozenset({"request", "itl", "prompt", "prefill", "generation", "decode", "engine",
                         "kv"}),
}


class ModelLabel:
    """A collector that yields `inner`'s metric families with model_name=<name()> appended to
    each sample's labels (none while name() is None, e.g. in unit tests)."""

    def __init__(self, inner: CollectorRegistry, name: Callable[[], str | None]):
        self.inner, self.name = inner, name

    def collect(self):
        model = self.name()
        for mf in self.inner.collect():
            if model is None:
                yield mf
                continue
            out = Metric(mf.name, mf.documentation, mf.type, mf.unit)
            out.samples = [s._replace(labels={**s.labels, "model_name": model}) for s in mf.samples]
            yield out


def exposed_registry(inner: CollectorRegistry, name: Callable[[], str | None]) -> CollectorRegistry:
    """A registry for /metrics that serves `inner` through ModelLabel."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ModelLabel(inner, name))
    return reg
