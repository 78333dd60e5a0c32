"""TTFT as a fitted model of the prefill engine's steps: observed TTFT (admit decision to first
token) regressed online on the work ahead of the prompt at its admit decision
(gateway/prefill_clock.py's `Ahead`):

    TTFT = c0 + c1 * busy + c2 * rest + c3 * queued + c4 * own + c5 * joining

    rest    = max(r * running - elapsed, 0): what remains of the step running now (0 if idle)
    queued  = tokens admitted and waiting for a later step
    own     = the prompt's own new tokens
    joining = min(arrival rate * (rest + r * queued), budget): the tokens expected to be
              admitted behind it before its step starts, which lengthen that step
    r       = c4, the fitted ms per prompt token (the prior until fitted)

The regressors depend on r, so each outcome keeps the state it was predicted in (a `sample`)
and every fit rebuilds them with the r of the fit before, twice over (a fixed point: r is the
slope it implies); regressors frozen with an early r (a prior off by 10x) would bias the fit for
as long as they stay in its window.

A queue model that charges a fixed rate per token ahead (the Predictor's raw TTFT) misses that
a prompt waits for whole steps: the rest of the running one, however few tokens it holds, and
its own one, which prompts admitted after it lengthen.

Fit: weighted least squares over the last WINDOW outcomes, each weighted by 1 / observed (the
error that matters is relative), iteratively reweighted with Huber weights (a residual beyond
HUBER x the median absolute relative residual counts as that bound), so a minority of stalls (a
cold engine's seconds, a GC pause) moves the coefficients by a bounded amount. Refitted lazily
at the first prediction after REFIT_EVERY new outcomes. Only outcomes already seen are used: no
prediction depends on its own outcome. Until MIN_SAMPLES outcomes, no prediction (None): the
caller falls back to its queue model.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from gateway.prefill_clock import Ahead

WINDOW = 256       # outcomes fitted (~8 s at 30 admitted requests a second)
MIN_SAMPLES = 16   # outcomes before the fit predicts
HUBER = 1.5        # residuals beyond this many median absolute residuals are downweighted
ITERATIONS = 3     # reweighting passes
N_STATE = 6  # running, queued, elapsed ms, tokens per ms, budget (0: none), own tokens
PASSES = 2   # fits with r rebuilt from the fit before
REFIT_EVERY = 4  # new outcomes between refits (a refit costs ~0.5 ms of the event loop)


class TtftFit:
    """The fit above: `sample` a prompt's state at its admit decision, `predict` from it, `add`
    the TTFT it then got."""

    def __init__(self, per_token_prior_ms: float = 0.5, window: int = WINDOW,
                 min_samples: int = MIN_SAMPLES):
        self.prior = per_token_prior_ms
        self.min_samples = min_samples
        self._s: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._coef: np.ndarray | None = None
        self._new = 0  # outcomes since the last fit
        self.samples = 0

    @property
    def per_token(self) -> float:
        """r: the fitted ms per prompt token (its own tokens' coefficient); the prior until
        fitted."""
        return _per_token(self.coef(), self.prior)

    @staticmethod
    def sample(ahead: Ahead, own_tokens: int) -> tuple[float, ...]:
        """The state a prompt with own_tokens new tokens is predicted in."""
        return (float(ahead.running_tokens), float(ahead.queued_tokens), float(ahead.elapsed_ms),
                float(ahead.tokens_per_ms), float(ahead.budget or 0), float(max(own_tokens, 1)))

    def add(self, sample: tuple[float, ...], observed_ms: float) -> None:
        """An outcome: the state it was predicted in and the TTFT it got."""
        if len(sample) != N_STATE or not observed_ms > 0 or not np.isfinite(observed_ms):
            return
        self._s.append(tuple(float(v) for v in sample))
        self._y.append(float(observed_ms))
        self.samples += 1
        self._new += 1

    def coef(self) -> np.ndarray | None:
        """(c0 .. c5) of the fit (None until fitted)."""
        due = self._new >= (REFIT_EVERY if self._coef is not None else 1)
        if due and len(self._y) >= self.min_samples:
            self._new = 0
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> np.ndarray | None:
        s, y = np.asarray(self._s), np.asarray(self._y)
        w = 1.0 / y
        c = self._coef
        for _ in range(PASSES):
            x = self.design(s, _per_token(c, self.prior))
            c = _irls(x, y, w, c)
            if c is None:
                return self._coef
        return c

    def design(self, s: np.ndarray, r: float) -> np.ndarray:
        """The regressors of states s at r (`design`; lab/admission_replay.py ablates some)."""
        return design(s, r)

    def predict(self, sample: tuple[float, ...]) -> float | None:
        """Predicted TTFT ms in `sample`'s state (None until fitted)."""
        c = self.coef()
        if c is None:
            return None
        v = float(self.design(np.asarray([sample], dtype=float), _per_token(c, self.prior))[0] @ c)
        return v if np.isfinite(v) else None


def design(s: np.ndarray, r: float) -> np.ndarray:
    """States (rows of N_STATE) -> regressors [1, busy, rest, queued, own, joining] at r."""
    running, queued, elapsed, rate, budget, own = s.T
    busy = (running > 0).astype(float)
    rest = np.maximum(r * running - elapsed, 0.0) * busy
    joining = rate * (rest + r * queued) * busy
    joining = np.where(budget > 0, np.minimum(joining, budget), joining)
    return np.stack([np.ones(len(s)), busy, rest, queued, own, joining], axis=1)


def _per_token(c: np.ndarray | None, prior: float) -> float:
    return min(max(float(c[4]), 1e-4), 10.0) if c is not None else prior


def _irls(x: np.ndarray, y: np.ndarray, w: np.ndarray, c: np.ndarray | None) -> np.ndarray | None:
    """Weighted least squares reweighted ITERATIONS times with Huber weights, from the residuals
    of c (the fit before: a plain least-squares start can sit far off when an outlier is much
    faster than predicted, whose 1 / observed weight is large) or of a plain fit."""
    c = _wls(x, y, w) if c is None else c
    for _ in range(ITERATIONS):
        if c is None:
            return None
        res = np.abs(x @ c - y) * w
        scale = float(np.median(res)) + 1e-9
        c = _wls(x, y, w * np.minimum(1.0, HUBER * scale / np.maximum(res, 1e-12)))
    return c


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """Weighted least squares (minimum-norm where a regressor never varied, e.g. never idle)."""
    try:
        c, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    except np.linalg.LinAlgError:
        return None
    return c if np.all(np.isfinite(c)) else None
