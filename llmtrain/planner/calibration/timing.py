"""How a calibration measurement is timed and summarised: runs repeated within a time budget (after a
warm-up), the fastest or each run, the least disturbed of several rounds, collective times made monotone in
their size, and the alpha-beta fit of a collective's times. Pure Python (what is timed brings its own torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def repeat(measure: Callable[[], float], seconds: float, min_runs: int = 1) -> list[float]:
    """What each call of `measure` returns, called after a warm-up call (allocation, kernel selection)
    until `seconds` have passed, at least `min_runs` times."""
    measure()
    values: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(values) < min_runs or time.perf_counter() < deadline:
        values.append(measure())
    return values


def run_times(fn, seconds: float, min_runs: int = 1) -> list[float]:
    """Seconds of each run of `fn` that fits in `seconds` after a warm-up run, at least `min_runs` runs."""

    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return repeat(timed, seconds, min_runs)


def best_time(fn, seconds: float, min_runs: int = 1) -> float:
    """The fastest of the runs of `fn` that fit in `seconds` after a warm-up run, at least `min_runs`."""
    return min(run_times(fn, seconds, min_runs))


def least_disturbed(rounds: list[float]) -> float:
    """The smallest of several rounds' medians: other processes' load and scheduling only ever add time to a
    round, so the least disturbed one is the closest to the operation's own time (each round a median
    already, one fast outlier cannot set it)."""
    if not rounds:
        raise ValueError("least_disturbed needs at least one round")
    return min(rounds)


def monotone_times(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(bytes, seconds) sorted by bytes with each time capped by every larger size's: a collective of fewer
    bytes never costs more than one of more (it could be sent padded), so a smaller size measured slower is
    noise (a disturbed round, a lazy set-up) and the larger size's time bounds it."""
    out = sorted(points)
    for i in range(len(out) - 2, -1, -1):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (alpha seconds, bytes per second) of time = alpha + bytes / bandwidth; alpha >= 0."""
    n = len(points)
    if n < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 message sizes; got {n}")
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    beta = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    beta = max(beta, 1e-15)  # a flat line: bandwidth beyond what was measured
    return max(my - beta * mx, 0.0), 1.0 / beta
