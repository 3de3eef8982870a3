"""Runs the chosen scenarios of `reprise bench` and gathers their results with the
settings they ran under."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from typing import Any

from . import scenarios
from .scenarios import Progress, Sizes
from .targets import Target

SCENARIOS = ("repeat", "prefix", "shared", "chat", "sweep", "hosttier")


def run_suite(
    names: Sequence[str],
    target: Target,
    sizes: Sizes,
    *,
    hosttier_targets: tuple[Target, Target] | None = None,
    progress: Progress = scenarios._no_progress,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Each scenario in `names` against `target` (hosttier against the pair of
    targets with and without a host tier; skipped, with a reason, without them)."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    results: dict[str, Any] = {
        "meta": {
            "target": target.name,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "sizes": {k: getattr(sizes, k) for k in sizes.__slots__},
            **(meta or {}),
        }
    }
    for name in names:
        if name == "hosttier":
            if hosttier_targets is None:
                results["skipped"] = {
                    "hosttier": "needs two in-process engines (host tier on, off)"
                }
                continue
            results[name] = scenarios.hosttier(*hosttier_targets, sizes, progress)
        else:
            results[name] = getattr(scenarios, name)(target, sizes, progress)
    return results
