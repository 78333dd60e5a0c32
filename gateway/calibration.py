"""Online fits behind admission's delay predictions: an exponentially weighted least-squares
line with a prior, a Theil-Sen line, and the calibration that corrects a raw prediction by what
requests then observed, per load bucket (its error is what the gateway's metrics report)."""
from __future__ import annotations

import math
from statistics import median
from collections import deque


class OnlineLinear:
    """y = a + b*x by exponentially weighted least squares (each new sample multiplies the
    old weights by `decay`), starting from a prior line (a, b). The slope is shrunk toward
    the prior's (ridge): data whose x spreads less than ~sqrt(ridge) (3%) of its mean cannot fix a
    slope, so then only the intercept fits; without data the prior line holds."""

    def __init__(self, a: float, b: float, decay: float = 0.97, ridge: float = 0.001):
        self.prior = (a, b)
        self.decay, self.ridge = decay, ridge
        self._s = [0.0] * 5  # sum w, wx, wy, wxx, wxy
        self.samples = 0

    def add(self, x: float, y: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._s[i] = self._s[i] * self.decay + v
        self.samples += 1

    def coef(self) -> tuple[float, float]:
        s0, sx, sy, sxx, sxy = self._s
        if s0 <= 0:
            return self.prior
        mx, my = sx / s0, sy / s0
        lam = self.ridge * s0 * mx * mx
        cxx, cxy = max(sxx - s0 * mx * mx, 0.0), sxy - s0 * mx * my
        b = (cxy + lam * self.prior[1]) / (cxx + lam) if cxx + lam > 0 else self.prior[1]
        b = max(b, 0.0)  # delays never shrink as their driver grows
        if my - b * mx < 0:  # nor does a delay have a negative fixed cost: fit through 0
            b = sxy / sxx if sxx > 0 else self.prior[1]
            return 0.0, max(b, 0.0)
        return my - b * mx, b

    def __call__(self, x: float) -> float:
        a, b = self.coef()
        return a + b * x


class RobustLinear:
    """y = a + b*x by Theil-Sen over the last `window` samples: b the median of the pairwise
    slopes of samples whose x differ by more than 10% of the mean x (else the median of y / x,
    a = 0), a the median of y - b*x; the prior line until the first sample. A minority of
    outliers (a cold engine's first calls: seconds instead of milliseconds) moves neither
    median, where one of them fixes a least-squares line; the fit follows a lasting change
    once it holds half the window."""

    def __init__(self, a: float, b: float, window: int = 48):
        self.prior = (a, b)
        self.xy: deque[tuple[float, float]] = deque(maxlen=window)
        self.samples = 0
        self._coef = self.prior

    def add(self, x: float, y: float) -> None:
        self.xy.append((float(x), float(y)))
        self.samples += 1
        self._coef = self._fit()

    def _fit(self) -> tuple[float, float]:
        pts = list(self.xy)
        mx = sum(x for x, _ in pts) / len(pts)
        gap = 0.1 * mx
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts)
                  for x2, y2 in pts[i + 1:] if abs(x2 - x1) > gap]
        if not slopes:
            return 0.0, max(median([y / x for x, y in pts if x > 0] or [self.prior[1]]), 0.0)
        b = max(median(slopes), 0.0)  # delays never shrink as their driver grows
        return median([y - b * x for x, y in pts]), b

    def coef(self) -> tuple[float, float]:
        return self._coef

    def min_ratio(self) -> float | None:
        """The smallest y / x in the window (None without samples)."""
        rs = [y / x for x, y in self.xy if x > 0]
        return min(rs) if rs else None

    def __call__(self, x: float) -> float:
        a, b = self._coef
        return a + b * x


OFFSET_WINDOW = 48  # bucket-0 residuals the additive offset is the median of
MEDIAN_AFTER = 8     # before that many, an EWMA (no single early outcome sets it alone)


class Calibrator:
    """Online correction of one predicted delay, per load bucket:
        corrected = offset + factor[bucket] * raw
    `offset` (additive=True only) is the fixed cost the model misses (RPCs, handoff
    bookkeeping), learned from bucket-0 samples (nothing queued ahead: the median of the last
    OFFSET_WINDOW residuals), where the raw model is the measured compute alone; factor[b] (fixed at 1 in bucket 0 when additive) is a
    log-space EWMA of (observed - offset) / raw in that bucket, clamped to
    [1 / max_factor, max_factor]. The slope on the raw prediction therefore never drops below
    1 / max_factor: the correction cannot collapse into a constant that ignores the model.
    Both start neutral (offset 0, factor 1) and move by `alpha` per outcome: the first
    outcomes after a start come while the underlying fits still learn (and a cold engine is
    slow), so none of them may set the correction alone.
    A bucket with fewer than `min_samples` outcomes uses the pooled factor of all buckets.
    `errors` holds the recent absolute percentage errors |corrected - observed| / observed of
    the predictions actually used; `ratios` the observed / corrected ratios per bucket."""

    def __init__(self, buckets: int = 4, additive: bool = True, max_factor: float = 2.0,
                 alpha: float = 0.15, max_offset_ms: float = 2000.0, min_samples: int = 4,
                 window: int = 256, factor_window: int | None = None):
        self.buckets, self.additive = buckets, additive
        # factor_window: a bucket's factor is the median of its last this many log ratios once
        # it has MEDIAN_AFTER (the EWMA until then): an EWMA of a ratio as dispersed as a
        # queued prompt's TTFT over its prediction swings 0.8-1.6 from one outcome to the next
        self._logs = [deque(maxlen=factor_window) for _ in range(buckets)] if factor_window else None
        self.max_factor, self.alpha = max_factor, alpha
        self.max_offset_ms, self.min_samples = max_offset_ms, min_samples
        self.offset = 0.0
        self._resid: deque[float] = deque(maxlen=OFFSET_WINDOW)
        self._log_f = [0.0] * buckets
        self._n = [0] * buckets
        self._pooled = 0.0  # log factor over all non-fixed buckets
        self._pooled_n = 0
        self.last_bucket = 0
        self.samples = 0
        self.errors: deque[float] = deque(maxlen=window)
        self.ratios = [deque(maxlen=64) for _ in range(buckets)]

    def _bucket(self, b: int) -> int:
        return min(max(int(b), 0), self.buckets - 1)

    def factor(self, bucket: int = 0) -> float:
        b = self._bucket(bucket)
        if self.additive and b == 0:
            return 1.0
        if self._logs is not None and len(self._logs[b]) >= MEDIAN_AFTER:
            return math.exp(median(self._logs[b]))
        if self._n[b] >= self.min_samples:
            return math.exp(self._log_f[b])
        return math.exp(self._pooled) if self._pooled_n else 1.0

    def correct(self, raw_ms: float, bucket: int = 0) -> float:
        v = self.offset + self.factor(bucket) * raw_ms
        return min(max(v, raw_ms / self.max_factor), raw_ms * self.max_factor + max(self.offset, 0.0))

    def headroom(self, q: float | None, bucket: int = 0, cap: float = 2.0) -> float:
        """Quantile q of the recent observed / corrected ratios of this bucket (all buckets'
        while it has fewer than 8), within [1, cap]; 1 with fewer than 8 samples or q None."""
        if q is None:
            return 1.0
        xs = self.ratios[self._bucket(bucket)]
        if len(xs) < 8:
            xs = [r for d in self.ratios for r in d]
        if len(xs) < 8:
            return 1.0
        xs = sorted(xs)
        return min(max(xs[min(int(q * len(xs)), len(xs) - 1)], 1.0), cap)

    def observe(self, raw_ms: float, used_ms: float, observed_ms: float,
                bucket: int = 0) -> float | None:
        """-> this sample's absolute percentage error (None for a sample that cannot count)."""
        if not (raw_ms > 0 and used_ms > 0 and observed_ms > 0) or math.isinf(observed_ms):
            return None
        b = self._bucket(bucket)
        lo, hi = 1.0 / self.max_factor, self.max_factor
        if self.additive and b == 0:
            # NOTE: a residual is clipped to [-raw / 2, max(offset, 0) + 2 x raw + 10 ms]: one
            # stalled request moves the offset by a bounded step, yet neither bound follows the
            # offset, or an offset pushed far off (by a cold, over-predicting fit) would come
            # back only ~raw per sample
            r = min(max(observed_ms - raw_ms, -raw_ms / 2), max(self.offset, 0.0) + 2 * raw_ms + 10.0)
            self._resid.append(r)
            # NOTE: the median of the recent residuals once there are enough: a request that
            # met a step of the other service on a shared device waits a step more (TTFT is
            # bimodal there); the median predicts the common case, an average neither
            if len(self._resid) >= MEDIAN_AFTER:
                self.offset = median(self._resid)
            else:
                self.offset += self.alpha * (r - self.offset)
            self.offset = min(max(self.offset, -self.max_offset_ms), self.max_offset_ms)
        else:
            x = math.log(min(max((observed_ms - self.offset) / raw_ms, lo), hi))
            self._log_f[b] += self.alpha * (x - self._log_f[b])
            if self._logs is not None:
                self._logs[b].append(x)
            self._pooled += self.alpha * (x - self._pooled)
            self._pooled_n += 1
        self._n[b] += 1
        self.last_bucket = b
        self.samples += 1
        err = abs(used_ms - observed_ms) / observed_ms
        self.errors.append(err)
        self.ratios[b].append(observed_ms / used_ms)
        return err

    def coef(self) -> tuple[float, float]:
        """(offset ms, factor of the bucket last observed) of the correction now."""
        return self.offset, self.factor(self.last_bucket)

    def mape(self) -> float | None:
        """Median absolute percentage error over the window (a fraction; None before data)."""
        if not self.errors:
            return None
        xs = sorted(self.errors)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


class AttainmentGuard:
    """Closed-loop control of one SLO's attainment among admitted requests: a factor g >= 1
    that multiplies the prediction admission decides on. Each admitted request's outcome moves
    log g by `step * (missed - (1 - target))`: up `step * target` for a miss, down
    `step * (1 - target)` for a hit, so g settles where the miss rate is 1 - target, whatever
    the models leave out (a shared GPU's prefill slowing decode steps, requests admitted later
    joining a batch). Bounded to [1, max_factor]; at low load every outcome is a hit and g
    decays to 1."""

    def __init__(self, target: float = 0.975, step: float = 0.05, max_factor: float = 4.0):
        if not 0.5 <= target < 1.0:
            raise ValueError(f"attainment target must be in [0.5, 1), got {target}")
        self.target, self.step, self.max_factor = target, step, max_factor
        self._log_g = 0.0
        self.samples = self.misses = 0

    def observe(self, observed_ms: float, slo_ms: float) -> None:
        if not (slo_ms > 0 and observed_ms >= 0):
            return
        missed = observed_ms > slo_ms
        self._log_g += self.step * (missed - (1.0 - self.target))
        self._log_g = min(max(self._log_g, 0.0), math.log(self.max_factor))
        self.samples += 1
        self.misses += missed

    @property
    def factor(self) -> float:
        return math.exp(self._log_g)
