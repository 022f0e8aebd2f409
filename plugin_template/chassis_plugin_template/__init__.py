"""chassis-plugin-template: an example chassis plugin package to copy.

What it provides, each through an entry point declared in ``pyproject.toml``:

* ``chassis.platform_plugins`` / ``template_platform`` -> :mod:`.platform`: an out-of-tree
  platform ``template_cpu`` (the host CPU under another name), usable only when
  ``CHASSIS_TEMPLATE_PLATFORM=1``.
* ``chassis.general_plugins`` / ``template`` -> :mod:`.plugin`: the scheduler
  ``template_sjf`` (:mod:`.scheduler`), the sampler ``template_greedy`` (:mod:`.sampler`), the
  ``--template-greeting`` flag and a ``chassis_configure`` hook that records it.

Importing this package is cheap and has no side effects: chassis imports the entry-point
modules in every process it starts.
"""

from __future__ import annotations

__version__ = "0.1.0"
