"""What admission works with: the gateway's view of a replica's load, admission's settings, a
prediction for one request (gateway/admission.py's Predictor) and the decision on it
(gateway/decide.py)."""
from __future__ import annotations

from dataclasses import dataclass

from gateway.prefill_clock import Ahead

TTFT_MODELS = ("fit", "queue")  # AdmissionConfig.ttft_model


@dataclass
class LoadView:
    """What the gateway knows about one replica (built from LoadStats + own bookkeeping)."""
    queued_tokens: int = 0  # prefill: prompt tokens waiting; decode: reserved tokens
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    mean_step_ms: float | None = None
    tokens_per_s: float | None = None
    device_id: str = ""     # LoadStats.device_id: equal on replicas sharing a device
    inflight_tokens: int = 0  # tokens the gateway has sent there and not seen finish
    inflight_requests: int = 0
    max_num_seqs: int | None = None  # decode: the batch's sequence cap (None: not reported)
    max_batched_tokens: int | None = None  # tokens a step takes (None: not reported)
    min_tpot_ms: float | None = None  # decode: tightest TPOT SLO it runs, any gateway's



@dataclass
class AdmissionConfig:
    default_ttft_ms: float | None = None  # applied when a request gives none
    default_tpot_ms: float | None = None
    prefill_tokens_per_s: float = 2000.0  # prior until measured
    decode_step_ms: float = 20.0  # prior until measured (batch of 1)
    transfer_ms_per_token: float = 0.01  # prior until measured
    overhead_ms: float = 1.0
    max_queue_ms: float = 30000.0  # a request never waits longer than this in admission
    kv_high_watermark: float = 0.95
    batch_slowdown: float = 0.05  # per extra running sequence, fraction of the base step time
    # a request predicted to miss its TTFT SLO by more than this fraction of the SLO is
    # rejected at once (None: queue it until its deadline instead), once the TTFT predictor
    # has been checked against calibration_min_samples outcomes (until then it queues)
    early_reject_slack: float | None = 0.0
    calibrate: bool = True  # online correction of the predictions (see Calibrator)
    # admission decides on the corrected estimate times this quantile of the recent
    # observed / estimated ratios (in [1, 2]; None: the estimate alone), so an estimate that
    # is right on average does not admit the requests it is too low for
    headroom_quantile: float | None = 0.95
    calibration_min_samples: int = 16
    # closed loop on top (AttainmentGuard): the admitted requests' measured misses scale the
    # loaded predictions until half the miss rate the quantile allows remains (the gateway
    # measures a little less delay than its clients do). "auto": on where the decode replica
    # runs on a GPU (--admission-guard)
    guard: str | bool = "auto"  # on | off | auto (True / False: on / off)
    # TTFT estimate: "fit" (TtftFit once it has outcomes, else the queue model) or "queue" (the
    # queue model corrected by its Calibrator); the fit learns either way
    ttft_model: str = "fit"

    def guard_on(self, device_id: str) -> bool:
        """Whether the guard scales predictions for a decode replica on `device_id`."""
        g = self.guard
        return g is True or g == "on" or (g == "auto" and device_id.startswith("cuda:"))

    @property
    def guard_fed(self) -> bool:
        """Whether the guards learn at all (not when off: nothing would read them)."""
        return self.guard not in (False, "off")

    def __post_init__(self):
        for k in ("prefill_tokens_per_s", "decode_step_ms"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0")
        if self.ttft_model not in TTFT_MODELS:
            raise ValueError(f"ttft_model must be one of {TTFT_MODELS}, got {self.ttft_model!r}")
        if self.guard not in (True, False, "on", "off", "auto"):
            raise ValueError(f"guard must be on, off or auto, got {self.guard!r}")
        q = self.headroom_quantile
        if q is not None and not 0.5 <= q < 1.0:
            raise ValueError(f"slo attainment (headroom quantile) must be in [0.5, 1), got {q}")
        for k in ("default_ttft_ms", "default_tpot_ms"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ValueError(f"{k} must be > 0 when set")


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    idle_ttft_ms: float  # what an idle prefill replica would give (the best case)
    idle_tpot_ms: float
    decode_full: bool
    cached_tokens: int = 0  # prompt tokens expected from the replica's prefix cache
    raw_ttft_ms: float | None = None  # the model before calibration (None: same)
    raw_tpot_ms: float | None = None
    est_ttft_ms: float | None = None  # the calibrated estimate before headroom (None: same)
    est_tpot_ms: float | None = None
    ttft_bucket: int = 0  # the Calibrator buckets this prediction falls in
    tpot_bucket: int = 0
    ahead: Ahead | None = None  # the prefill steps ahead (None: not known, prefilled here)
    ttft_sample: tuple | None = None  # TtftFit's state of it (the fit learns from its outcome)
    fit_ttft_ms: float | None = None  # TtftFit's estimate (None: not fitted yet)
    decode_batch: int = 0


@dataclass(frozen=True)
class Decision:
    kind: str  # "admit" | "queue" | "reject"
    reason: str
    prediction: Prediction | None = None
    retry_after_s: float = 0.0
