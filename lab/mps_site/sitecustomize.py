"""Lab only: give one service an MPS share of the GPU's SMs. CUDA reads
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE when the process creates its context, so this sets it at
interpreter start for the service named in LAB_MPS_SERVICE (decode_svc / prefill_svc)."""
import os

_svc, _pct = os.environ.get("LAB_MPS_SERVICE"), os.environ.get("LAB_MPS_PCT")
if _svc and _pct:
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _argv = _f.read().decode(errors="replace").split("\0")
    except OSError:
        _argv = []
    if _svc in _argv:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = _pct
