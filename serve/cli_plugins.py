"""``chassis plugins``: every discovered entry point, whether it loaded, and what it added."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from chassis.plugins.manager import GROUPS, PluginLoadError, PluginManager


def add_parser(subparsers: Any) -> None:
    """Register the ``plugins`` sub-command."""
    parser = subparsers.add_parser(
        "plugins",
        help="list the installed plugins, their status and what they registered",
        description="Load the platform and general plugins of this process (honouring "
        "CHASSIS_PLUGINS) and list every discovered entry point: its distribution, whether it "
        "loaded, the hooks it implements and the names it registered.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _records(manager: PluginManager, registered: dict[str, dict[str, list[str]]]) -> list[dict]:
    rows = []
    for group in GROUPS:
        for record in manager.discover(group):
            rows.append(
                {
                    "group": record.group,
                    "name": record.name,
                    "value": record.value,
                    "distribution": record.distribution,
                    "builtin": record.is_builtin,
                    "status": record.status,
                    "reason": record.reason,
                    "hooks": record.hooks,
                    "registered": registered.get(record.name, {}),
                }
            )
    return rows


def collect_plugins(manager: PluginManager) -> dict[str, Any]:
    """Load both groups and report them.

    :raises PluginLoadError: a plugin failed to load or a registration hook failed.
    """
    from chassis.plugins.registries import get_registries

    manager.load_platform_plugins()
    manager.load_general_plugins()
    registries = get_registries()
    # plugin name -> registry -> names it registered there
    registered: dict[str, dict[str, list[str]]] = {}
    owners: dict[str, dict[str, str]] = {}
    for registry_name, registry in registries.items():
        owners[registry_name] = {n: registry.owner(n) for n in registry.names()}
        for owner in set(owners[registry_name].values()):
            registered.setdefault(owner, {})[registry_name] = registry.names_by(owner)
    return _report(manager, registered, owners)


def _report(
    manager: PluginManager,
    registered: dict[str, dict[str, list[str]]],
    owners: dict[str, dict[str, str]],
) -> dict[str, Any]:
    from chassis.plugins import PLUGIN_API_VERSION

    return {
        "plugin_api_version": PLUGIN_API_VERSION,
        "allow_list": sorted(manager.allow_list) if manager.allow_list is not None else None,
        "deny_list": sorted(manager.deny_list),
        "unknown_allow_list_names": manager.unknown_allowed_names(),
        "plugins": _records(manager, registered),
        "registries": owners,
    }


def format_text(report: dict[str, Any]) -> str:
    """The human-readable form of a report from :func:`collect_plugins`."""
    lines = [f"Plugin API version {report['plugin_api_version']}"]
    if report["allow_list"] is not None:
        lines.append(f"CHASSIS_PLUGINS allow-list: {', '.join(report['allow_list']) or '(empty)'}")
    if report["deny_list"]:
        lines.append(f"CHASSIS_PLUGINS excludes: {', '.join(report['deny_list'])}")
    if report["unknown_allow_list_names"]:
        lines.append(
            "  warning: no entry point is named " + ", ".join(report["unknown_allow_list_names"])
        )
    for group in GROUPS:
        lines.append(f"{group}:")
        for p in (p for p in report["plugins"] if p["group"] == group):
            status = p["status"] + (f" ({p['reason']})" if p["reason"] else "")
            lines.append(f"  {p['name']} = {p['value']}  [{p['distribution']}]  {status}")
            if p["hooks"]:
                lines.append(f"    hooks: {', '.join(p['hooks'])}")
            for registry_name, names in p["registered"].items():
                lines.append(f"    {registry_name}: {', '.join(names)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report; on a load failure print the error and exit 1."""
    from chassis.plugins import get_plugin_manager

    manager = get_plugin_manager()
    try:
        report = collect_plugins(manager)
    except PluginLoadError as exc:
        logging.getLogger(__name__).debug("plugin load failed", exc_info=True)
        # Show every entry point's state, the failed one included, then the error.
        partial = _report(manager, {}, {})
        if args.json:
            print(json.dumps({**partial, "error": str(exc)}, indent=2))
        else:
            print(format_text(partial))
        print(f"chassis plugins: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({**report, "error": None}, indent=2) if args.json else format_text(report))
    return 0
