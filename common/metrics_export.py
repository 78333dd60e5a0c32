"""What a ServiceMetrics registry exposes: the series groups of each role (EXPORTS), and the
served model's name as a `model_name` label on every sample (as vLLM labels its series), added
at scrape time so no call site names it.

Several processes of one role (gateway workers sharing a port) export as one: with
PROMETHEUS_MULTIPROC_DIR set in their environment before prometheus_client is imported, each
writes its values to files there and every scrape, whichever worker answers it, sums counters
and histograms over all of them (gauges combine by their `multiprocess_mode`)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

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


class AllWorkers:
    """A collector of the families registered in `inner`, with every worker's values read
    from the multiprocess directory (a process writes every metric it creates there, those of
    other roles too: only inner's names pass)."""

    def __init__(self, inner: CollectorRegistry, path: str):
        from prometheus_client.multiprocess import MultiProcessCollector

        self.inner, self.all = inner, MultiProcessCollector(None, path)
        self._names: set[str] | None = None

    def collect(self):
        if self._names is None:  # NOTE: ServiceMetrics registers every family before a scrape
            self._names = {mf.name for mf in self.inner.collect()}
        for mf in self.all.collect():
            if mf.name in self._names:
                yield mf


def exposed_registry(inner: CollectorRegistry, name: Callable[[], str | None],
                     multiproc_dir: str | None = None) -> CollectorRegistry:
    """A registry for /metrics that serves `inner` (all workers' values, with multiproc_dir)
    through ModelLabel."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ModelLabel(AllWorkers(inner, multiproc_dir) if multiproc_dir else inner, name))
    return reg
