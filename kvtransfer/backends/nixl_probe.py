"""Where the nixl Python API comes from, without importing the nixl backend (which pulls in
the pair service): the services' flag check (endpoint.backend_unavailable) uses this.

The registry's `nixl` meta package requires both nixl-cu12 and nixl-cu13; either wheel alone
is enough here, so the per-CUDA modules are tried after the meta package."""
from __future__ import annotations

import importlib

NOT_INSTALLED = ("nixl is not installed (pip install nixl-cu12, or nixl-cu13 for CUDA 13; "
                 "they bring UCX): --kv-transfer-backend nixl cannot run here, use grpc or dist")
MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def nixl_api():
    """The nixl._api module of whichever NIXL wheel imports; ImportError naming all tried."""
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # NOTE: also a wheel whose native libraries do not load
            errors.append(f"{name}: {e}")
    raise ImportError("; ".join(errors))


def nixl_available() -> bool:
    try:
        nixl_api()
    except ImportError:
        return False
    return True
