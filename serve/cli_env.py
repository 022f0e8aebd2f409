"""``chassis env``: versions, the chosen platform and why, what every detector saw, devices."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform as py_platform
import sys
from typing import Any

#: distributions whose versions ``chassis env`` reports (None when not installed)
_PACKAGES = ("torch", "triton", "transformers", "pluggy")


def add_parser(subparsers: Any) -> None:
    """Register the ``env`` sub-command."""
    parser = subparsers.add_parser(
        "env",
        help="show versions, the detected platform and why, and the devices",
        description="Show versions, the platform chassis selects in this process and why, "
        "what each platform detector saw, and the devices with their memory.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_versions() -> dict[str, str | None]:
    """chassis, python and the key dependencies; ``None`` for what is not installed."""
    import chassis

    versions: dict[str, str | None] = {
        "chassis": chassis.__version__,
        "python": f"{py_platform.python_version()} ({sys.executable})",
    }
    for name in _PACKAGES:
        versions[name] = _version(name)
    return versions


def _safe_detail(cls: type) -> str:
    # env is the diagnostic tool: a detector that crashes is reported, not fatal.
    try:
        return cls.detection_detail()
    except Exception as exc:
        return f"detection failed: {type(exc).__name__}: {exc}"


def collect_detectors() -> dict[str, dict[str, Any]]:
    """What each built-in platform's detector sees here: availability and a one-line detail."""
    from chassis.platforms.cpu import CpuPlatform
    from chassis.platforms.cuda import CudaPlatform
    from chassis.platforms.rocm import RocmPlatform
    from chassis.platforms.tpu import TpuPlatform
    from chassis.platforms.xpu import XpuPlatform

    out: dict[str, dict[str, Any]] = {}
    for cls in (CpuPlatform, CudaPlatform, RocmPlatform, XpuPlatform, TpuPlatform):
        try:
            available: bool | None = bool(cls.is_available())
        except Exception:
            available = None
        out[cls.name] = {"available": available, "detail": _safe_detail(cls)}
    return out


def collect_platform_plugins(manager: Any) -> list[dict[str, Any]]:
    """Every loaded ``chassis_platform`` hookimpl and what it offers in this process."""
    plugins = []
    for plugin_name, offered in manager.call_each("chassis_platform"):
        entry: dict[str, Any] = {
            "plugin": plugin_name,
            "distribution": manager.distribution_of(plugin_name),
            "builtin": manager.is_builtin(plugin_name),
            "offers": getattr(offered, "name", None),
        }
        if offered is not None:
            entry["detail"] = _safe_detail(offered)
        plugins.append(entry)
    return plugins


def collect_devices(current: Any) -> list[dict[str, Any]]:
    """Name and memory (bytes) of each device of the chosen platform."""
    devices = []
    for index in range(current.device_count()):
        devices.append(
            {
                "index": index,
                "name": current.device_name(index),
                "memory_total": current.memory_total(index),
                "memory_available": current.memory_available(index),
            }
        )
    return devices


def collect_env() -> tuple[dict[str, Any], str | None]:
    """Everything ``chassis env`` shows, and the error that stopped platform selection."""
    from chassis.platforms import PlatformError, get_current_platform
    from chassis.plugins import PluginLoadError, get_plugin_manager

    report: dict[str, Any] = {
        "versions": collect_versions(),
        "detectors": collect_detectors(),
        "platform": None,
        "devices": [],
        "platform_plugins": [],
    }
    try:
        current = get_current_platform()
        report["platform"] = current.describe()
        report["platform"]["selection_reason"] = current.selection_reason
        report["devices"] = collect_devices(current)
        report["platform_plugins"] = collect_platform_plugins(get_plugin_manager())
    except (PlatformError, PluginLoadError) as exc:
        return report, f"{type(exc).__name__}: {exc}"
    return report, None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.1f} GiB"


def format_text(report: dict[str, Any], error: str | None) -> str:
    """The human-readable form of a report from :func:`collect_env`."""
    lines = ["Versions:"]
    lines += [f"  {k:<13} {v or 'not installed'}" for k, v in report["versions"].items()]
    lines.append("Platform:")
    platform_info = report["platform"]
    if platform_info is None:
        lines.append(f"  none selected: {error}")
    else:
        lines.append(f"  {platform_info['platform']} (device type {platform_info['device_type']})")
        lines.append(f"  why: {platform_info['selection_reason']}")
        lines.append(f"  dtypes: {', '.join(platform_info['supported_dtypes'])}")
        lines.append(f"  graph capture: {platform_info['graph_capture']}")
        lines.append(f"  distributed backend: {platform_info['dist_backend']}")
    lines.append("Built-in platform detectors:")
    for name, det in report["detectors"].items():
        state = {True: "usable", False: "not usable", None: "error"}[det["available"]]
        lines.append(f"  {name:<5} {state:<10} {det['detail']}")
    if report["platform_plugins"]:
        lines.append("Platform plugins:")
        for p in report["platform_plugins"]:
            offers = p["offers"] or "nothing"
            lines.append(f"  {p['plugin']} ({p['distribution']}): offers {offers}")
    if report["devices"]:
        lines.append("Devices:")
        for d in report["devices"]:
            lines.append(
                f"  [{d['index']}] {d['name']}: {_gib(d['memory_available'])} available "
                f"of {_gib(d['memory_total'])}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when no platform could be selected."""
    report, error = collect_env()
    if args.json:
        print(json.dumps({**report, "error": error}, indent=2))
    else:
        print(format_text(report, error))
    if error is not None:
        print(f"chassis env: {error}", file=sys.stderr)
        return 1
    return 0
