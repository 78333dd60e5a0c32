"""Online fits behind admission's delay predictions: an EWMA, an exponentially weighted
least-squares line with a prior, and the calibration that corrects a raw prediction by what
requests then observed (its error is what the gateway's metrics report)."""
from __future__ import annotations

import math
from collections import deque


class Ewma:
    def __init__(self, initial: float | None, alpha: float = 0.3):
        self.value = initial
        self.alpha = alpha
        self.samples = 0

    def update(self, x: float) -> float:
        if x is None or x != x or x <= 0:  # ignore NaN / non-positive measurements
            return self.value
        self.value = x if self.value is None or self.samples == 0 else \
            self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


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
        return my - b * mx, b

    def __call__(self, x: float) -> float:
        a, b = self.coef()
        return a + b * x


class Calibrator:
    """Online correction of one predicted delay: observed ~ a + b * raw prediction
    (OnlineLinear from the identity: while the raw predictions barely vary, an offset), the
    corrected value
    kept within [raw / max_factor, raw * max_factor]; `errors` holds the recent absolute
    percentage errors |corrected - observed| / observed of the predictions actually used."""

    def __init__(self, window: int = 256, max_factor: float = 4.0):
        self.max_factor = max_factor
        self.fit: OnlineLinear | None = None
        self.samples = 0
        self.errors: deque[float] = deque(maxlen=window)
        self.ratios: deque[float] = deque(maxlen=64)  # observed / estimate, recent

    def headroom(self, q: float | None, cap: float = 2.0) -> float:
        """Quantile q of the recent observed / estimated ratios, within [1, cap] (1 with
        fewer than 8 samples or q None)."""
        if q is None or len(self.ratios) < 8:
            return 1.0
        xs = sorted(self.ratios)
        return min(max(xs[min(int(q * len(xs)), len(xs) - 1)], 1.0), cap)

    def correct(self, raw_ms: float) -> float:
        if self.fit is None:
            return raw_ms
        return min(max(self.fit(raw_ms), raw_ms / self.max_factor), raw_ms * self.max_factor)

    def observe(self, raw_ms: float, used_ms: float, observed_ms: float) -> float | None:
        """-> this sample's absolute percentage error (None for a sample that cannot count)."""
        if not (raw_ms > 0 and used_ms > 0 and observed_ms > 0) or math.isinf(observed_ms):
            return None
        if self.fit is None:
            self.fit = OnlineLinear(0.0, 1.0, decay=0.9)  # ~10 samples: load shifts fast
        self.fit.add(raw_ms, observed_ms)
        self.samples += 1
        err = abs(used_ms - observed_ms) / observed_ms
        self.errors.append(err)
        self.ratios.append(observed_ms / used_ms)
        return err

    def coef(self) -> tuple[float, float]:
        """(offset ms, scale) of the correction now."""
        return self.fit.coef() if self.fit is not None else (0.0, 1.0)

    def mape(self) -> float | None:
        """Median absolute percentage error over the window (a fraction; None before data)."""
        if not self.errors:
            return None
        xs = sorted(self.errors)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
