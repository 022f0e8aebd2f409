"""Where an engine step's time goes: host phases, device busy time and the top kernels.

:func:`time_phases` wraps the engine core's three calls (``schedule``, the executor's
``execute_model_async``, ``update_from_output``) with wall-clock timers for
some steps; :func:`profile_steps` runs steps under ``torch.profiler`` with every activity this
torch build supports (CPU, plus the accelerator's kernels where there is one) and sums the
device's busy time. Their difference from the wall time is what the device spends waiting for
the host, the number async scheduling exists to shrink. Used by ``chassis bench step
--profile``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType


@dataclass
class PhaseTimes:
    """Milliseconds per step spent inside each engine-core call (host wall clock)."""

    num_steps: int
    wall_ms: float
    phases_ms: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        parts = [f"{name} {ms:.3f}" for name, ms in self.phases_ms.items()]
        # The wait for the sampled ids (the previous step's, under async scheduling) falls in
        # here, with the output bookkeeping.
        parts.append(f"other {max(0.0, self.wall_ms - sum(self.phases_ms.values())):.3f}")
        return [f"  host: {self.wall_ms:.3f} ms per step ({', '.join(parts)})"]


@dataclass
class StepProfile:
    """What ``torch.profiler`` saw over ``num_steps`` steps."""

    num_steps: int
    wall_ms: float
    #: summed self time of every device (non-CPU) event, per step; None without a device
    device_busy_ms: float | None
    #: (name, calls per step, device or CPU self time per step in ms), largest first
    top: list[tuple[str, float, float]]

    def lines(self) -> list[str]:
        out = [f"  profiled: {self.wall_ms:.3f} ms per step (wall, profiler on)"]
        if self.device_busy_ms is None:
            out.append("  device: no device activity recorded (host-only platform)")
            kind = "CPU self"
        else:
            idle = max(0.0, self.wall_ms - self.device_busy_ms)
            out.append(
                f"  device: busy {self.device_busy_ms:.3f} ms per step, idle {idle:.3f} ms "
                f"({100 * idle / self.wall_ms:.0f} % of the step waits for the host)"
            )
            kind = "device"
        out.append(f"  top {len(self.top)} by {kind} time per step:")
        for name, calls, ms in self.top:
            out.append(f"    {ms:8.3f} ms  {calls:6.1f}x  {name[:100]}")
        return out


@contextmanager
def _wrapped(obj: Any, names: list[str], totals: dict[str, float]) -> Iterator[None]:
    """Time calls of ``obj``'s methods ``names`` into ``totals`` (seconds) while active."""
    originals: dict[str, Callable[..., Any]] = {}
    for name in names:
        original = getattr(obj, name)
        originals[name] = original

        def timed(*args: Any, _original: Callable[..., Any] = original, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(obj, name, timed)
    try:
        yield
    finally:
        for name in originals:
            delattr(obj, name)  # back to the class's method


def time_phases(engine: Any, num_steps: int) -> PhaseTimes:
    """Run ``num_steps`` steps of ``engine`` (an ``EngineCore``) timing its three calls."""
    totals: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    with (
        _wrapped(engine.scheduler, ["schedule", "update_from_output"], totals),
        _wrapped(engine.executor, ["execute_model_async"], totals),
    ):
        for _ in range(num_steps):
            engine.step()
    wall = time.perf_counter() - start
    order = ["schedule", "execute_model_async", "update_from_output"]
    phases = {name: totals[name] * 1e3 / num_steps for name in order}
    return PhaseTimes(num_steps, wall * 1e3 / num_steps, phases)


def profile_steps(
    engine: Any, num_steps: int, top: int = 15, trace_path: Path | None = None
) -> StepProfile:
    """Run ``num_steps`` steps under ``torch.profiler``; optionally write a Chrome trace."""
    from chassis.platforms import get_current_platform

    platform = get_current_platform()
    activities = list(torch.profiler.supported_activities())
    platform.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        platform.synchronize()
        wall = time.perf_counter() - start
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    events = prof.key_averages()
    # Device events only: a CPU op also reports the time of the kernels it launched as its own
    # device time, and annotations span kernels, so either would count kernels twice.
    device = [
        e
        for e in events
        if e.device_type != DeviceType.CPU
        and not getattr(e, "is_user_annotation", False)
        and e.self_device_time_total > 0
    ]
    if device:
        busy: float | None = sum(e.self_device_time_total for e in device) / 1e3 / num_steps
        ranked = sorted(device, key=lambda e: e.self_device_time_total, reverse=True)
        rows = [
            (e.key, e.count / num_steps, e.self_device_time_total / 1e3 / num_steps)
            for e in ranked[:top]
        ]
    else:
        busy = None
        ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        rows = [
            (e.key, e.count / num_steps, e.self_cpu_time_total / 1e3 / num_steps)
            for e in ranked[:top]
        ]
    return StepProfile(num_steps, wall * 1e3 / num_steps, busy, rows)
