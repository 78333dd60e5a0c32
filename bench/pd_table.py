"""bench/pd_system.py's table: one row a case, the engine alone beside the whole system, with
their ratio (TTFT against the engine's + TTFT_SLACK_MS: the hops a request cannot avoid)."""
from __future__ import annotations

TTFT_SLACK_MS = 5.0
COLS = ["case", "engine alone", "whole system", "ratio"]


def cell(res: dict, case: str, key: str):
    """A figure, an 'error: ...' string (the case or the whole side failed) or None."""
    v = res.get(case, res.get("error"))
    if isinstance(v, str):
        return v
    return None if v is None else v.get(key)


def ratio(sys_v, eng_v, kind: str):
    if not all(isinstance(v, (int, float)) and v == v and v > 0 for v in (sys_v, eng_v)):
        return ""
    return sys_v / (eng_v + TTFT_SLACK_MS) if kind == "ttft" else sys_v / eng_v


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v if len(v) <= 60 else v[:57] + "..."
    if v != v:
        return "nan"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def build_rows(eng: dict, sysr: dict, a) -> list[dict]:
    """Rows of the table: (label, case, key, ratio kind); derived rows (p99/median, on/off)."""
    c = a.clients
    spec = [(f"TTFT {k[5:]}-token prompt, ms", k, "ms_median", "ttft")
            for k in sorted((k for k in {**eng, **sysr} if k.startswith("ttft_")),
                            key=lambda k: int(k[5:]))]
    spec += [(f"{c} clients: output tok/s", "load", "tok_s", "rate"),
             (f"{c} clients: TTFT median, ms", "load", "ttft_ms_median", "ttft"),
             (f"{c} clients: TPOT median, ms", "load", "tpot_ms", "time"),
             ("ITL median, whole run, ms", "load", "itl_ms_median", "time"),
             ("ITL p99, whole run, ms", "load", "itl_ms_p99", "time"),
             ("ITL p99/median, whole run", "load", "itl_p99/median", "time"),
             ("ITL median, after all first tokens, ms", "load", "itl_after_first_ms_median", "time"),
             ("ITL p99, after all first tokens, ms", "load", "itl_after_first_ms_p99", "time"),
             ("ITL p99/median, after all first tokens", "load", "itl_after_first_p99/median", "time"),
             ("ITL mean at the client, ms (load)", "load", "itl_ms_mean", "time"),
             ("ITL mean at the gateway, ms (load; its ITL histogram)", "hops", "gateway_itl_ms_mean", None),
             ("ITL mean at decode, ms (load; its ITL histogram)", "hops", "decode_itl_ms_mean", None),
             *((f"{r} CPU, share of one core (load)", "hops", f"{r}_cpu_share", None)
               for r in ("client", "gateway", "prefill", "decode")),
             (f"TPOT logprobs off ({a.lp_batch} req), ms", "lp_off", "tpot_ms", "time"),
             (f"TPOT logprobs on ({a.lp_batch} req), ms", "lp_on", "tpot_ms", "time"),
             ("client messages per token (load; < 1: gaps are per message)", "load",
              "messages/token", None),
             ("KV bytes per request (load case)", "kv", "bytes_per_request", None),
             ("KV transfer backend", "kv", "backend", None),
             ("KV handoff, prefill side (first token -> ack), mean ms, single requests", "kv_ttft",
              "send_ms_mean", None),
             ("KV handoff, decode side (bytes -> done), mean ms, single requests", "kv_ttft",
              "recv_ms_mean", None),
             ("KV handoff, prefill side, mean ms, load case", "kv", "send_ms_mean", None)]
    rows = []
    for label, case, key, kind in spec:
        ev, sv = cell(eng, case, key), cell(sysr, case, key)
        if case in ("kv", "kv_ttft", "hops"):
            ev = "-"
        rows.append({"case": label, "engine alone": fmt(ev), "whole system": fmt(sv),
                     "ratio": fmt(ratio(sv, ev, kind)) if kind else ""})
    on_off = [cell(r, "lp_on", "tpot_ms") for r in (eng, sysr)]
    off = [cell(r, "lp_off", "tpot_ms") for r in (eng, sysr)]
    rows.append({"case": "TPOT logprobs on/off", "engine alone": fmt(ratio(on_off[0], off[0], "rate")),
                 "whole system": fmt(ratio(on_off[1], off[1], "rate")), "ratio": ""})
    return rows


def add_derived(res: dict) -> dict:
    load = res.get("load")
    if isinstance(load, dict):
        load["messages/token"] = load["messages"] / load["tokens"]
        for pre in ("itl", "itl_after_first"):
            load[f"{pre}_p99/median"] = ratio(load[f"{pre}_ms_p99"], load[f"{pre}_ms_median"], "rate") or None
    return res
