"""Online ridge regression with exponential forgetting, optionally with non-negative coefficients.

State: the decayed normal equations A = sum(d^age w x x^T), b = sum(d^age w y x) and the coefficients solved from
them: O(n^2) numbers for n inputs, whatever the number of observations. They are kept as s A' and s b', numpy
arrays with one scale s for both: an observation multiplies s by d and adds w / s x x^T to A' (one outer product),
instead of multiplying every entry by d; the solution of A c = b is that of A' c = b', so a refit reads A' and b'
as they are (the ridge term is relative to A's trace). s is folded into A' and b' before it would underflow. Every
`refit_every` observations the coefficients are re-solved. Measured on ~2,000 observations the predictor recorded in
`epp-bench handler-cpu --streamed` (13 inputs, refit every 8), per observation, add and refit: 15.9-17.5 us with A
as nested lists, its upper triangle updated entry by entry and decayed, and made an array at each refit; 10.9-11.8
us now (two runs each). Unlike recursive least squares
with forgetting, which updates the inverse and whose covariance winds up along directions the data stops
exciting, the ridge term here is added at each solve, so the solve is always well posed.

`nonnegative`: every coefficient >= 0, solved by an active set on the normal equations (Lawson-Hanson: free the
input whose coefficient would lower the error most, re-solve on the free ones, bind any that turn negative; at
most 3n solves of at most n x n), started from the previous fit: between refits the normal equations move a little
and the inputs in use rarely change, so a refit takes one or two solves instead of one per input in use (measured
on the predictor's 13 inputs over 4,000 drifting observations, refitting every 8: 42 -> 15 us of CPU per
observation, add and refit; the EPP learns two targets from every access-log record).
Non-negative because, for latency in inputs that each measure work (queued tokens, requests, KV usage), this is
physics, not tuning: more work never makes a request faster. An unconstrained fit of correlated
inputs can give one a negative coefficient, and a router that picks the smallest prediction then prefers the most
loaded endpoint wherever that input is large (measured: a negative in-flight x batch term drew 30 requests onto
one of 8 sim servers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The scale of the kept normal equations is folded into them below this (0.998 per observation reaches it after
# ~115,000 observations; the entries then are at most ~1e100 times A's, far inside a float's range).
FOLD_SCALE_BELOW = 1e-100


class OnlineRidge:
    """Weighted least squares over exponentially forgotten observations, plus a small ridge penalty.

    Parameters: size (inputs per observation), decay (each observation's weight shrinks by this factor per later
    observation: 0.998 keeps a memory of ~500), ridge (penalty relative to the mean diagonal of A), refit_every.
    """

    def __init__(
        self, size: int, decay: float = 0.998, ridge: float = 1e-4, refit_every: int = 8, nonnegative: bool = False
    ):
        if size < 1 or not 0.0 < decay <= 1.0 or ridge <= 0.0 or refit_every < 1:
            raise ValueError("OnlineRidge: size >= 1, 0 < decay <= 1, ridge > 0 and refit_every >= 1 required")
        self.size, self.decay, self.ridge, self.refit_every = size, decay, ridge, refit_every
        self.nonnegative = nonnegative
        self._a = np.zeros((size, size))  # A / _scale
        self._b = np.zeros(size)  # b / _scale
        self._scale = 1.0
        self.coefficients: tuple[float, ...] | None = None  # None until the first fit
        self.count = 0

    def add(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        scale = self._scale * self.decay
        if scale < FOLD_SCALE_BELOW:
            self._a *= scale
            self._b *= scale
            scale = 1.0
        self._scale = scale
        x = np.asarray(x, dtype=float)
        wx = x * (weight / scale)
        self._a += np.multiply.outer(wx, x)
        self._b += wx * y
        self.count += 1
        if self.count % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Solve (A + ridge I) c = b (with c >= 0 when nonnegative); the coefficients stay as they were if A is
        still all zero."""
        a = self._a.copy()
        scale = float(np.trace(a)) / self.size
        if scale <= 0.0:
            return
        a.flat[:: self.size + 1] += self.ridge * scale
        b = self._b
        c = _nonnegative_solve(a, b, self.coefficients) if self.nonnegative else np.linalg.solve(a, b)
        self.coefficients = tuple(c.tolist())

    def predict(self, x: Sequence[float]) -> float:
        """c . x; 0.0 before the first fit."""
        c = self.coefficients
        if c is None:
            return 0.0
        return sum(ci * xi for ci, xi in zip(c, x, strict=True))


def _nonnegative_solve(a: np.ndarray, b: np.ndarray, start: tuple[float, ...] | None = None) -> np.ndarray:
    """argmin over c >= 0 of c'Ac/2 - b'c for a positive definite A (least squares from its normal equations),
    starting from `start` (its finite positive coefficients are the first free set, the others start at 0) or from
    0. A is positive definite, so the minimum is unique: the start changes how many solves it takes, not the
    answer."""
    n = len(b)
    c = np.zeros(n) if start is None else np.array(start, dtype=float)
    free = (c > 0.0) & np.isfinite(c)  # a coefficient that is not a finite number starts bound
    c[~free] = 0.0
    for _ in range(3 * n):
        while free.any():  # solve on the free inputs; move towards it until one would turn negative, bind it
            idx = np.flatnonzero(free)
            solution = np.zeros(n)
            solution[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if solution[idx].min() > 0:
                c = solution
                break
            falling = idx[solution[idx] <= 0]
            steps = c[falling] / (c[falling] - solution[falling])
            c = c + steps.min() * (solution - c)
            free &= c > 1e-15
            c[~free] = 0.0
        gradient = b - a @ c  # the direction that lowers the error; > 0 for a bound input: freeing it helps
        bound = np.flatnonzero(~free)
        if bound.size == 0 or gradient[bound].max() <= 1e-12 * float(np.abs(b).max() or 1.0):
            break
        free[bound[np.argmax(gradient[bound])]] = True
    return c
