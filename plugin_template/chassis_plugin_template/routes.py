"""``GET /template/stats``: the template's HTTP route on ``chassis serve``.

Registered through ``chassis_register_routes``; chassis adds it after the built-in routes,
behind the same API key and error handling. It answers what the ``template_counter`` stat
logger counted (``null`` when that logger was not selected with ``--stat-loggers``) and the
engine's current queue lengths.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from chassis.serve.plugin_routes import get_engine
from chassis_plugin_template.stats import TemplateCounterStatLogger

#: every path of a plugin gets its own prefix: a path the server already serves is a
#: start-up error
router = APIRouter(prefix="/template", tags=["chassis-plugin-template"])


@router.get("/stats")
async def template_stats(request: Request) -> dict[str, Any]:
    """The ``template_counter`` counts, and the engine's running and waiting requests."""
    engine = get_engine(request)
    counter = next(
        (s for s in engine.stat_loggers if isinstance(s, TemplateCounterStatLogger)), None
    )
    scheduler = engine.stats()
    return {
        "model": engine.model_name,
        "stat_logger": None if counter is None else counter.snapshot(),
        "running": scheduler.num_running,
        "waiting": scheduler.num_waiting,
    }
