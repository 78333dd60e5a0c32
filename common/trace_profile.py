"""Profiling on demand over gRPC: `splitserve.admin.v1.Profiler/Profile` on prefill and decode.

The request and answer are JSON objects (no .proto: a generic handler with JSON serializers):

    {"steps": N, "timeout_s": 60}  ->  {"path": ".../decode-<pid>-<time>.json", "steps": n,
                                        "wall_s": s}

The service records a torch.profiler trace of its engine's next N steps (engine/profiling.py)
and writes it as a Chrome trace (chrome://tracing, Perfetto) under its --profile-dir. The
caller names no path: a service writes only where its operator pointed it. Without
--profile-dir the call is FAILED_PRECONDITION.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import grpc

SERVICE = "splitserve.admin.v1.Profiler"
METHOD = f"/{SERVICE}/Profile"


def _loads(b: bytes) -> dict:
    try:
        d = json.loads(b or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"request is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("request must be a JSON object")
    return d


def _dumps(d: dict) -> bytes:
    return json.dumps(d).encode()


def add_profile_service(server, engine, service: str, profile_dir: str | None) -> None:
    """Register the Profiler handler on a grpc.aio server for this engine (AsyncEngine)."""

    async def profile(raw: bytes, context) -> dict:
        try:
            req = _loads(raw)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not profile_dir:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"profiling is off: start the {service} service with --profile-dir DIR")
        steps, timeout_s = req.get("steps", 10), req.get("timeout_s", 60.0)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"timeout_s must be a number, got {timeout_s!r}")
        path = os.path.join(profile_dir, f"{service}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}"
                                         f"-{time.monotonic_ns() % 10**6:06d}.json")
        from engine.profiling import ProfileBusyError

        try:
            return await engine.profile(steps, path, float(timeout_s))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ProfileBusyError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (asyncio.TimeoutError, TimeoutError):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not finish the profile")
        except (RuntimeError, OSError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"profiling failed: {e}")

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Profile": grpc.unary_unary_rpc_method_handler(profile, request_deserializer=lambda b: b,
                                                       response_serializer=_dumps)})
    server.add_generic_rpc_handlers((handler,))


def call_profile(address: str, steps: int, timeout_s: float, metadata=()) -> dict:
    """Client side (splitserve profile): -> the service's answer; raises grpc.RpcError."""
    with grpc.insecure_channel(address) as ch:
        fn = ch.unary_unary(METHOD, request_serializer=_dumps, response_deserializer=json.loads)
        return fn({"steps": steps, "timeout_s": timeout_s}, timeout=timeout_s + 150,
                  metadata=tuple(metadata))
