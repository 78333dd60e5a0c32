"""StepProfiler: profile the next N engine steps of a running engine on request, and NVTX
ranges around every step when the engine runs on CUDA (for nsys; no-ops elsewhere).

The engine thread calls tick() once per loop turn and wraps each step in step(); any thread
calls request(), which answers through a concurrent.futures.Future once the trace is written.
torch.profiler starts and stops on the engine thread (the thread whose steps it records);
stopping holds the engine for as long as torch processes the events (1 s for 20 steps of 100
ops on a loaded 2-core CPU); writing the file runs on its own thread.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class _Job:
    steps: int
    path: str
    deadline: float  # time.monotonic() past which it stops with the steps it has
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    prof: object = None
    done_steps: int = 0
    t0: float = 0.0


class ProfileBusyError(RuntimeError):
    """A profile is already being recorded."""


class StepProfiler:
    def __init__(self, nvtx: bool | None = None):
        """nvtx: NVTX range per step; None = on when CUDA is initialised in this process by the
        first step (an engine on CUDA has loaded its weights there by then)."""
        self._nvtx = nvtx
        self._lock = threading.Lock()
        self._job: _Job | None = None  # requested or running
        self._step = 0
        self._rec = self._range = None  # the job recording the current step, its range
        self._nvtx_now = False

    # ---- any thread ------------------------------------------------------------------------
    def request(self, steps: int, path: str, timeout_s: float = 60.0) -> concurrent.futures.Future:
        """Record the next `steps` steps into the Chrome trace `path`; the future gets
        {"path", "steps", "wall_s"}; fewer steps when timeout_s passes first (an idle engine).
        Raises ValueError for bad arguments, ProfileBusyError while another one runs."""
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 10000:
            raise ValueError(f"steps must be an integer in [1, 10000], got {steps!r}")
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600], got {timeout_s!r}")
        job = _Job(steps, path, time.monotonic() + timeout_s)
        with self._lock:
            if self._job is not None:
                raise ProfileBusyError(f"a profile of {self._job.steps} steps is already being "
                                       f"recorded to {self._job.path}")
            self._job = job
        return job.future

    # ---- engine thread ---------------------------------------------------------------------
    def tick(self) -> None:
        """Start a requested profile; end one whose time is up. Cheap when idle."""
        job = self._job
        if job is None:
            return
        if job.prof is None:
            self._start(job)
        elif time.monotonic() >= job.deadline:
            self._finish(job)

    def step(self) -> "StepProfiler":
        """Around one engine step (`with profiler.step():`): an NVTX range, and a profiler step
        while recording. NOTE: plain __enter__/__exit__: tick + step cost ~1 us when neither is on."""
        return self

    def __enter__(self) -> None:
        self._step += 1
        job = self._job
        self._rec = job if job is not None and job.prof is not None else None
        if self._nvtx is None:  # decided at the first step: a CUDA engine is up by then
            self._nvtx = _cuda_up()
        self._nvtx_now = self._nvtx
        if self._nvtx_now:
            torch.cuda.nvtx.range_push(f"engine.step {self._step}")
        if self._rec is not None:
            self._range = torch.profiler.record_function(f"engine.step {self._step}")
            self._range.__enter__()

    def __exit__(self, *exc) -> None:
        job = self._rec
        if job is not None:
            self._range.__exit__(*exc)
            self._rec = self._range = None
        if self._nvtx_now:
            torch.cuda.nvtx.range_pop()
        if job is not None:
            job.done_steps += 1
            job.prof.step()
            if job.done_steps >= job.steps:
                self._finish(job)

    def _start(self, job: _Job) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if _cuda_up():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(job.path)), exist_ok=True)
            job.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            job.prof.__enter__()
            job.t0 = time.monotonic()
        except Exception as e:  # noqa: BLE001 - reported to the requester, the engine goes on
            self._job = None
            job.future.set_exception(e)

    def _finish(self, job: _Job) -> None:
        self._job = None
        wall_s = round(time.monotonic() - job.t0, 4)
        try:
            job.prof.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 - reported to the requester, the engine goes on
            job.future.set_exception(e)
            return

        def export() -> None:
            try:
                job.prof.export_chrome_trace(job.path)
                job.future.set_result({"path": job.path, "steps": job.done_steps, "wall_s": wall_s})
            except Exception as e:  # noqa: BLE001 - reported to the requester
                job.future.set_exception(e)

        # NOTE: writing a GPU trace of many steps takes seconds: not on the engine thread
        threading.Thread(target=export, name="profile-export", daemon=True).start()

    def cancel(self, why: str = "engine stopped") -> None:
        """Fail a pending or running request (engine shutdown)."""
        job, self._job = self._job, None
        if job is not None and not job.future.done():
            job.future.set_exception(RuntimeError(why))



def _cuda_up() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()
