"""Online ridge regression with exponential forgetting, in pure Python: it learns one observation at a time, where
numpy's per-call overhead would cost more than it saves (predicting for all candidates at once is numpy's, in
`LatencyPredictor.predict_endpoints`).

State: the decayed normal equations A = sum(d^age w x x^T), b = sum(d^age w y x) and the coefficients solved from
them: O(n^2) numbers for n inputs, whatever the number of observations. `add` is O(n^2) (a rank-one update of A's
upper triangle); every `refit_every` observations the coefficients are re-solved by Cholesky, O(n^3 / 6) (~80 us
for n = 13 in pure Python). Unlike recursive least squares with forgetting, which updates the inverse and whose
covariance winds up along directions the data stops exciting, the ridge term here is added at each solve, so the
solve is always well posed.
"""

from __future__ import annotations

import math


class OnlineRidge:
    """Weighted least squares over exponentially forgotten observations, plus a small ridge penalty.

    Parameters: size (inputs per observation), decay (each observation's weight shrinks by this factor per later
    observation: 0.998 keeps a memory of ~500), ridge (penalty relative to the mean diagonal of A), refit_every.
    """

    def __init__(self, size: int, decay: float = 0.998, ridge: float = 1e-4, refit_every: int = 8):
        if size < 1 or not 0.0 < decay <= 1.0 or ridge <= 0.0 or refit_every < 1:
            raise ValueError("OnlineRidge: size >= 1, 0 < decay <= 1, ridge > 0 and refit_every >= 1 required")
        self.size, self.decay, self.ridge, self.refit_every = size, decay, ridge, refit_every
        self._a = [[0.0] * size for _ in range(size)]  # upper triangle used
        self._b = [0.0] * size
        self.coefficients: tuple[float, ...] | None = None  # None until the first fit
        self.count = 0

    def add(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        decay, a, b = self.decay, self._a, self._b
        for i, xi in enumerate(x):
            row, wxi = a[i], weight * xi
            for j in range(i, self.size):
                row[j] = row[j] * decay + wxi * x[j]
            b[i] = b[i] * decay + wxi * y
        self.count += 1
        if self.count % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Solve (A + ridge I) c = b by Cholesky; the coefficients stay as they were if A is still all zero."""
        n, a = self.size, self._a
        scale = sum(a[i][i] for i in range(n)) / n
        if scale <= 0.0:
            return
        penalty = self.ridge * scale
        low = [[0.0] * n for _ in range(n)]  # L with L L^T = A + penalty I
        for i in range(n):
            for j in range(i + 1):
                total = (a[j][i] if j < i else a[i][i] + penalty) - sum(low[i][k] * low[j][k] for k in range(j))
                if i == j:
                    low[i][i] = math.sqrt(max(total, penalty * 1e-6))
                else:
                    low[i][j] = total / low[j][j]
        z = [0.0] * n
        for i in range(n):
            z[i] = (self._b[i] - sum(low[i][k] * z[k] for k in range(i))) / low[i][i]
        c = [0.0] * n
        for i in reversed(range(n)):
            c[i] = (z[i] - sum(low[k][i] * c[k] for k in range(i + 1, n))) / low[i][i]
        self.coefficients = tuple(c)

    def predict(self, x: tuple[float, ...]) -> float:
        """c . x; 0.0 before the first fit."""
        c = self.coefficients
        if c is None:
            return 0.0
        return sum(ci * xi for ci, xi in zip(c, x, strict=True))
