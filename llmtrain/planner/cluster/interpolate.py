"""Interpolation of calibrated tables: matmul throughput over FLOPs, collective time over message bytes.

Calibration (llmtrain.planner.calibration) measures a handful of sizes; the cost model needs every size in
between. A matmul's efficiency rises smoothly over decades of FLOPs, so its rate interpolates linearly in
log(FLOPs); outside the measured range it keeps the nearest measured rate (the curve is flat at the large
end; the table starts at kernels small enough that nothing a layer issues is much smaller). A collective's
time goes from a latency floor to linear in bytes, a power law between any two sizes, so it interpolates
linearly in log(time) over log(bytes) (linear in log(bytes) alone would bend a linear stretch upwards, by 2x
half-way across a 16x gap); below the smallest size it costs that size's time (the floor) and above the
largest it grows at the last measured segment's seconds per byte (the alpha-beta model's bandwidth term).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def _sorted_points(points: Sequence[Sequence[float]], what: str) -> list[tuple[float, float]]:
    """(x, y) pairs sorted by x, equal x averaged; x must be positive."""
    if not points:
        raise ValueError(f"{what}: the table is empty")
    merged: dict[float, list[float]] = {}
    for x, y in points:
        if x <= 0:
            raise ValueError(f"{what}: sizes must be positive; got {x}")
        merged.setdefault(float(x), []).append(float(y))
    return sorted((x, sum(ys) / len(ys)) for x, ys in merged.items())


def _log_lerp(pts: list[tuple[float, float]], x: float, log_y: bool = False) -> float:
    """y at x, linear in log(x) (and in log(y) with `log_y`) between the neighbouring points (x inside the
    table)."""
    xs = [p[0] for p in pts]
    i = min(max(bisect.bisect_left(xs, x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    if log_y:
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return y0 + t * (y1 - y0)


def rate_at(points: Sequence[Sequence[float]], flops: float) -> float:
    """Achieved rate at `flops` from measured (flops, rate) points: linear in log(flops) between them, the
    nearest measured rate outside."""
    pts = _sorted_points(points, "matmul table")
    if flops <= pts[0][0]:
        return pts[0][1]
    if flops >= pts[-1][0]:
        return pts[-1][1]
    return _log_lerp(pts, flops)


def time_at(points: Sequence[Sequence[float]], nbytes: float) -> float:
    """Seconds for `nbytes` from measured (bytes, seconds) points: log(time) linear in log(bytes) between
    them, the smallest size's time below them, and the last segment's seconds per byte beyond them."""
    pts = _sorted_points(points, "collective table")
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if len(pts) == 1:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + max(y1 - y0, 0.0) / (x1 - x0) * (nbytes - x1)
    return _log_lerp(pts, nbytes, log_y=True)
