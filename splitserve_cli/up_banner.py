"""`splitserve up`'s banner: the URLs, the served model name (asked of the gateway with its own
API key and over its own TLS) and the engine flags the gateway must share."""
from __future__ import annotations

import argparse


def gateway_shared_flags(engine_args: list[str]) -> list[str]:
    """The engine flags the gateway must agree on (context length, served name)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-model-len")
    p.add_argument("--served-model-name")
    known, _ = p.parse_known_args(engine_args)
    out = []
    if known.max_model_len:
        out += ["--max-model-len", known.max_model_len]
    if known.served_model_name:
        out += ["--served-model-name", known.served_model_name]
    return out


def _connect_host(host: str) -> str:
    """The address a local client dials for a bind address (a wildcard is not dialable)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def gateway_front(gw_args: list[str]) -> tuple[str | None, str | None]:
    """-> (an API key the gateway accepts, its TLS certificate path), each None when off: read
    from the gateway's own flags and environment, as the gateway reads them."""
    from gateway.auth import collect_keys
    from gateway.config import add_args as gateway_add_args

    p = argparse.ArgumentParser(add_help=False)
    gateway_add_args(p)
    g, _ = p.parse_known_args(gw_args)
    try:
        keys = collect_keys(g.api_key, g.api_key_file)
    except (OSError, ValueError):  # the gateway itself reports a bad key file
        keys = ()
    return (keys[0] if keys else None), g.tls_cert


def served_model_name(grpc_addr: str, api_key: str | None = None, tls_cert: str | None = None
                      ) -> str | None:
    """The name clients must send as "model", from the gateway's ModelInfo (None if it fails),
    asked with the gateway's own key and over TLS trusting its own certificate."""
    try:
        import grpc

        from protos import generate_pb2, generate_pb2_grpc

        if tls_cert:
            with open(tls_cert, "rb") as f:
                ch = grpc.secure_channel(grpc_addr, grpc.ssl_channel_credentials(f.read()))
        else:
            ch = grpc.insecure_channel(grpc_addr)
        md = [("authorization", f"Bearer {api_key}")] if api_key else None
        with ch:
            return generate_pb2_grpc.GenerationStub(ch).ModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=10, metadata=md).model
    except Exception:  # noqa: BLE001 - the banner prints what it can
        return None


def banner(a: argparse.Namespace, engine_args: list[str], backend: str | None, gport, hport,
           pport, dport, mports=("-1", "-1"), front: tuple[str | None, str | None] = (None, None)
           ) -> str:
    """front: the gateway's (API key, TLS certificate), see gateway_front."""
    host = _connect_host(a.host)
    h = f"[{host}]" if ":" in host else host
    name = served_model_name(f"{h}:{gport}", *front)
    export = "splitserve tokenizer export"
    if a.model != "default":
        export += f" --model {a.model}"
    served_flag = gateway_shared_flags(engine_args)
    if "--served-model-name" in served_flag:
        export += f" --served-model-name {served_flag[served_flag.index('--served-model-name') + 1]}"
    scheme = "https" if front[1] else "http"
    rest = (f"{scheme}://{h}:{hport}/v1   (also /tokenize, /detokenize, /health, /metrics)"
            if str(hport) != "-1" else "off")
    metrics = "   ".join(f"{n} http://{h}:{p}/metrics" for n, p in zip(("prefill", "decode"), mports)
                           if str(p) != "-1") or "prefill / decode off (--metrics-ports)"
    n = getattr(a, "gateway_workers", 1)
    workers = (f"  gateway        {n} worker processes on the REST and gRPC ports (/metrics: all)\n"
               if n > 1 else "")
    how = (f"colocated: prompts prefilled on decode, {a.decode_threads} threads"
           if getattr(a, "resolved_topology", "split") == "colocated"
           else f"split, KV transfer: {backend or 'auto'}")
    return (f"splitserve is up (model {a.model}, {how}):\n"
            f"  REST (OpenAI)  {rest}\n"
            f"  gRPC           {h}:{gport}   (splitserve.v1.Generation)\n"
            f"  model name     {name or '?'}   (what clients send as \"model\")\n"
            f"  tokenizer      `{export}` writes it as a HF tokenizer directory "
            f"(./{name or '<model name>'}) for benchmark tools\n"
            f"  prefill        {h}:{pport}\n  decode         {h}:{dport}\n"
            f"  metrics        {metrics}\n"
            f"{workers}Ctrl-C stops them all.")
