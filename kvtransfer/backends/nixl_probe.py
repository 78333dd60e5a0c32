"""Whether the nixl package is importable, without importing the nixl backend (which pulls
in the pair service): the services' flag check (endpoint.backend_unavailable) uses this."""
from __future__ import annotations

NOT_INSTALLED = ("nixl is not installed (pip install nixl; it also needs UCX): "
                 "--kv-transfer-backend nixl cannot run here, use grpc or dist")


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True
