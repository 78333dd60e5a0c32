"""`splitserve up` turns prefill's and decode's /metrics on by default (9101, 9102), prints their
URLs in its banner, and they answer with the served model's series; `--metrics-ports off`
leaves them off."""
from __future__ import annotations

import argparse
import re
import urllib.request

import pytest

from splitserve_cli import up, up_banner
from tests.harness import TINY_CPU, UP_PORTS, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_args(p)
    return p.parse_known_args(list(argv))[0]


def test_metrics_ports_default_on(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_METRICS_PORTS", raising=False)
    assert _args().metrics_ports == "9101,9102"
    monkeypatch.setattr(up_banner, "served_model_name", lambda addr, *_: "m")
    text = up.banner(_args(), [], None, 50051, 8000, 50061, 50071, ("9101", "9102"))
    assert "prefill http://127.0.0.1:9101/metrics" in text and "decode http://127.0.0.1:9102/metrics" in text
    off = up.banner(_args(), [], None, 50051, 8000, 50061, 50071, ("-1", "-1"))
    assert "off (--metrics-ports)" in off


def test_up_serves_metrics_on_the_ports_in_its_banner():
    # UP_PORTS asks for free metrics ports (0,0): the banner names the ones bound
    with splitserve_up([*UP_PORTS, *TINY_CPU]) as u:
        line = next(ln for ln in u.log().splitlines() if ln.strip().startswith("metrics"))
        urls = dict(re.findall(r"(prefill|decode) (http://\S+/metrics)", line))
        assert set(urls) == {"prefill", "decode"}, line
        model = re.search(r"model name\s+(\S+)", u.log()).group(1)
        for role, url in urls.items():
            body = urllib.request.urlopen(url, timeout=5).read().decode()
            assert f'splitserve_kv_cache_usage_ratio{{model_name="{model}"}}' in body, role
            assert "splitserve_admission" not in body, role
