"""bench/peer_cpu.py's pure parts (flags, figures over rounds, the table's ratios) and the vLLM
command of bench/peer_servers.py."""
import pytest

from bench import peer_cpu as pc
from bench import peer_servers
from bench.pd_clients import Trace


def _trace(t_send, first, n, gap):
    tr = Trace(t_send)
    tr.events = [(first + i * gap, 1) for i in range(n)]
    return tr


def test_parse_streams_and_variant():
    assert pc.parse_streams("1,8,32,8") == [1, 8, 32]
    for bad in ("", "0", "1,-2"):
        with pytest.raises(ValueError):
            pc.parse_streams(bad)
    assert pc.parse_variant("split:") == ("split", [])
    assert pc.parse_variant("pod:--gateway-arg=--prefill-on-decode=always --cpu-threads 2") == (
        "pod", ["--gateway-arg=--prefill-on-decode=always", "--cpu-threads", "2"])
    assert pc.parse_variant("split") == ("split", ["--topology", "split"])  # up's split services
    assert pc.parse_variant("colocated") == ("colocated", ["--topology", "colocated"])
    for bad in ("nocolon", ":--x"):
        with pytest.raises(ValueError):
            pc.parse_variant(bad)


def test_case_stats_medians_over_runs():
    runs = [[_trace(0.0, 0.1, 11, 0.05)], [_trace(0.0, 0.3, 11, 0.05)], [_trace(0.0, 0.2, 11, 0.05)]]
    s = pc.case_stats(runs)
    assert s["ttft_ms"] == pytest.approx(200.0)
    assert s["tpot_ms"] == pytest.approx(50.0)
    assert s["tokens"] == 33 and s["runs"] == 3
    assert s["tok_s"] == pytest.approx(11 / (0.2 + 0.5))


def test_merge_rounds_and_rows():
    r1 = {"streams_1": {"tok_s": 10.0, "ttft_ms": 200.0, "tpot_ms": 50.0}, "streams_8": "error: x"}
    r2 = {"streams_1": {"tok_s": 14.0, "ttft_ms": 100.0, "tpot_ms": 40.0}, "streams_8": "error: y"}
    m = pc.merge_rounds([r1, r2])
    assert m["streams_1"]["tok_s"] == 12.0 and m["streams_1"]["rounds"] == 2
    assert m["streams_8"] == "error: y"
    peer = {"streams_1": {"tok_s": 24.0, "ttft_ms": 75.0, "tpot_ms": 45.0},
            "streams_8": {"tok_s": 100.0, "ttft_ms": 400.0, "tpot_ms": 50.0}}
    rows, cols = pc.build_rows({"splitserve": m, "vllm": peer}, [1, 8])
    assert cols == ["case", "figure", "splitserve", "vllm", "vllm / splitserve"]
    by = {(r["case"], r["figure"]): r for r in rows}
    assert by[("1 stream", "tokens/s")]["vllm / splitserve"] == "2.00x"   # peer faster: > 1
    assert by[("1 stream", "TTFT ms")]["vllm / splitserve"] == "2.00x"    # 150 / 75
    assert by[("1 stream", "TPOT ms")]["vllm / splitserve"] == "1.00x"    # 45 / 45
    assert by[("8 streams", "tokens/s")]["splitserve"] == "error: y"
    assert by[("8 streams", "tokens/s")]["vllm / splitserve"] == ""


def test_speedup_needs_two_numbers():
    assert pc.speedup(None, 3.0, "higher") == ""
    assert pc.speedup(2.0, float("nan"), "lower") == ""
    assert pc.speedup(2.0, 4.0, "lower") == 0.5


def test_vllm_command_and_env():
    cmd = peer_servers.vllm_cmd("/v/bin/python", "/hf", 8123, 2048, 32)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/hf"
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--port") + 1] == "8123"
    env = peer_servers.vllm_env(2, 1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_parse_args_variants():
    a = pc.parse_args(["--variant", "a:", "--variant", "b:--cpu-threads 2"])
    assert a.variants == [("a", []), ("b", ["--cpu-threads", "2"])]
    assert pc.parse_args([]).variants == [("splitserve", [])]
    v = pc.parse_args(["--vllm-only"])
    assert v.vllm and v.variants == []
