"""Logging setup for the service processes (one format, level from flag or SPLITSERVE_LOG_LEVEL)."""
from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None, service: str = "") -> None:
    """Idempotent: reconfigures the root logger each call (tests may call it twice)."""
    from common.envs import env_str

    lvl = (level or env_str("SPLITSERVE_LOG_LEVEL", "INFO")).upper()
    if lvl not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {lvl!r}")
    fmt = FORMAT if not service else f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s"
    logging.basicConfig(level=lvl, format=fmt, stream=sys.stderr, force=True)
    # grpc's own chatter is noisy at INFO
    logging.getLogger("grpc").setLevel(max(logging.WARNING, logging.getLevelName(lvl)))
