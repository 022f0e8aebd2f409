"""vLLM's compilation settings mapped onto chassis' own: ``-O N`` and ``compilation_config``.

vLLM sets up ``torch.compile`` and CUDA graphs with an *optimization level* (``-O0`` ..
``-O3``, ``LLM(optimization_level=N)``) and a ``CompilationConfig`` (``--compilation-config
JSON``, ``LLM(compilation_config=dict or int)``). chassis has three settings for the same
concerns (:class:`~chassis.core.config.EngineConfig`): ``torch_compile``,
``cuda_graph_sizes`` and ``enforce_eager``. This module maps the first onto the second:

=====================================  ===============================================
vLLM                                   chassis
=====================================  ===============================================
optimization level 0                   ``torch_compile=False``, ``cuda_graph_sizes=[]``
optimization level 1, 2 or 3           ``torch_compile=True``, decode graphs
``mode`` (or ``level``) 0 / ``NONE``   ``torch_compile=False``
``mode`` 1-3 (or its name)             ``torch_compile=True``
``cudagraph_mode`` ``NONE``            ``cuda_graph_sizes=[]`` (no graphs, compile kept)
any other ``cudagraph_mode``           decode graphs (chassis' only kind)
``cudagraph_capture_sizes`` [a, b..]   ``cuda_graph_sizes=[a, b, ..]``; ``[]``: none
``max_cudagraph_capture_size`` N       ``cuda_graph_sizes=[N]`` (the pattern up to N)
=====================================  ===============================================

The contract:

- :func:`read_compilation_config` reads a ``compilation_config`` (a dict of the keys in
  :data:`ACCEPTED_KEYS`, or an int: the ``mode``) into a :class:`CompilationRequest`. A key
  not in :data:`ACCEPTED_KEYS` (none of vLLM's other keys is a no-op there: each changes how
  vLLM compiles or captures, which chassis cannot do), a value of the wrong type, and keys
  that disagree with each other are a ``ValueError`` naming the flag and the key.
- :func:`compilation_request` adds an optimization level. As in vLLM, a level only sets
  defaults: a key of the config wins over what the level implies (``-O3`` with
  ``cudagraph_mode NONE`` compiles and captures nothing).
- :func:`apply_compilation_request` turns a request into ``EngineConfig`` keyword arguments
  beside the ones the user gave. A chassis setting given that disagrees with the request
  (``--enforce-eager`` with ``-O3``, other ``--cuda-graph-sizes``) is a ``ValueError``
  naming both; chassis does not pick one.
- :func:`compilation_kwargs` does all of it for ``LLM(**kwargs)``.

Messages name the command-line flags (``--compilation-config``, ``-O3``, ``--enforce-eager``),
as ``EngineConfig``'s do; ``LLM`` passes its argument names for the vLLM side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

#: vLLM's ``CompilationMode`` names and their values (key ``mode``; ``level`` is its older
#: name and takes the same values)
COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}
#: vLLM's ``CUDAGraphMode`` names (key ``cudagraph_mode``, any case)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: vLLM's optimization levels (``-O0`` .. ``-O3``)
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
#: the ``compilation_config`` keys chassis maps; every other key is refused
ACCEPTED_KEYS = (
    "mode",
    "level",
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
)


class Asked(NamedTuple):
    """One thing vLLM's settings ask for, and which flag and key asked (for messages)."""

    value: Any
    source: str


@dataclass(frozen=True)
class CompilationRequest:
    """What vLLM's compilation settings ask of chassis; ``None``: nothing asked."""

    #: compile the model's forward (``torch_compile``)
    compile: Asked | None = None
    #: capture decode graphs at all (False: ``cuda_graph_sizes=[]``)
    graphs: Asked | None = None
    #: the capture sizes, sorted and unique, in ``cuda_graph_sizes``' forms (one value: the
    #: default pattern up to it; several: exactly those)
    sizes: Asked | None = None


def read_compilation_config(config: Any, flag: str = "--compilation-config") -> CompilationRequest:
    """What ``config`` (vLLM's ``compilation_config``: a dict, or an int mode) asks for.

    ``None`` values count as not given (vLLM's defaults). ``ValueError`` naming ``flag`` for
    anything else than a dict or an int, an unknown key, a bad value, and keys that disagree.
    """
    if isinstance(config, bool) or not isinstance(config, int | dict):
        raise ValueError(
            f"{flag} must be a mapping of vLLM's CompilationConfig keys (e.g. "
            f'{{"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}}) or a compilation mode '
            f"0-3; got {type(config).__name__} {config!r}"
        )
    if isinstance(config, int):
        config = {"mode": config}
    given = {str(key): value for key, value in config.items() if value is not None}
    unknown = [key for key in given if key not in ACCEPTED_KEYS]
    if unknown:
        raise ValueError(
            f"{flag}: {'keys' if len(unknown) > 1 else 'key'} {', '.join(map(repr, unknown))} "
            f"not supported; chassis maps {', '.join(ACCEPTED_KEYS)} (see docs/gpu.md)"
        )
    compile_ = _compile_asked(given, flag)
    graph_mode = None
    if "cudagraph_mode" in given:
        name = given["cudagraph_mode"]
        if not isinstance(name, str) or name.strip().upper() not in CUDAGRAPH_MODES:
            raise ValueError(
                f"{flag}: cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got {name!r}"
            )
        name = name.strip().upper()
        graph_mode = Asked(name != "NONE", _source(flag, "cudagraph_mode", name))
    sizes = _sizes_asked(given, flag)
    if graph_mode is not None and sizes is not None and graph_mode.value != bool(sizes.value):
        what = "captures no graphs" if not graph_mode.value else "captures graphs"
        raise ValueError(
            f"{graph_mode.source} and {sizes.source.removeprefix(flag + ' ')} disagree: the "
            f"mode {what}, the sizes ask for {'some' if sizes.value else 'none'}; drop one"
        )
    graphs = graph_mode
    if graphs is None and sizes is not None:
        graphs = Asked(bool(sizes.value), sizes.source)
    return CompilationRequest(
        compile_, graphs, sizes if sizes is not None and sizes.value else None
    )


def check_optimization_level(level: Any, name: str = "-O") -> int:
    """``level`` if it is one of :data:`OPTIMIZATION_LEVELS`, else ``ValueError``."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in OPTIMIZATION_LEVELS:
        raise ValueError(f"{name} must be 0, 1, 2 or 3 (vLLM's optimization levels); got {level!r}")
    return level


def compilation_request(
    config: Any = None,
    level: int | None = None,
    *,
    flag: str = "--compilation-config",
    level_source: str | None = None,
) -> CompilationRequest:
    """What an optimization ``level`` and a ``config`` ask for together: the level's defaults
    (0: no compilation and no graphs; 1-3: compilation and graphs), overridden by what the
    config's keys ask. ``level_source`` names the level in messages (default ``-O<level>``)."""
    asked = CompilationRequest() if config is None else read_compilation_config(config, flag)
    if level is None:
        return asked
    level = check_optimization_level(level)
    default = Asked(level > 0, level_source or f"-O{level}")
    return CompilationRequest(
        default if asked.compile is None else asked.compile,
        default if asked.graphs is None else asked.graphs,
        asked.sizes,
    )


def apply_compilation_request(
    request: CompilationRequest, settings: dict[str, Any]
) -> dict[str, Any]:
    """``settings`` (the ``EngineConfig`` keyword arguments given) with ``torch_compile`` and
    ``cuda_graph_sizes`` set as ``request`` asks. ``ValueError`` naming both when a setting
    given disagrees: ``enforce_eager=True`` with compilation or graphs asked,
    ``torch_compile`` other than asked, ``cuda_graph_sizes`` other than asked."""
    out = dict(settings)
    eager = settings.get("enforce_eager") is True
    given_compile = settings.get("torch_compile")
    given_sizes = settings.get("cuda_graph_sizes")
    if request.compile is not None:
        on, source = request.compile
        if on and eager:
            raise _disagree(
                source,
                "--enforce-eager",
                f"{source} compiles the model's forward, --enforce-eager compiles nothing",
            )
        if given_compile is not None and bool(given_compile) != on:
            flag = "--torch-compile" if given_compile else "torch_compile=False"
            what = "compiles" if on else "does not compile"
            raise _disagree(source, flag, f"{source} {what} the model's forward")
        out["torch_compile"] = on
    if request.graphs is not None:
        on, source = request.graphs
        if on and eager:
            raise _disagree(
                source, "--enforce-eager", f"{source} captures graphs, --enforce-eager none"
            )
        if given_sizes is not None and bool(given_sizes) != on:
            what = "captures graphs" if on else "captures no graphs"
            raise _disagree(source, _sizes_flag(given_sizes), f"{source} {what}")
        if not on:
            out["cuda_graph_sizes"] = []
    if request.sizes is not None:
        sizes, source = request.sizes
        if given_sizes is not None and sorted(set(given_sizes)) != sizes:
            raise _disagree(
                source, _sizes_flag(given_sizes), "they ask for different capture sizes"
            )
        out["cuda_graph_sizes"] = list(sizes)
    return out


def compilation_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)``'s keyword arguments with vLLM's ``compilation_config`` (a dict or an
    int mode) and ``optimization_level`` taken out and applied to the others."""
    kwargs = dict(kwargs)
    config = kwargs.pop("compilation_config", None)
    level = kwargs.pop("optimization_level", None)
    if config is None and level is None:
        return kwargs
    if level is not None:
        check_optimization_level(level, "optimization_level")
    request = compilation_request(
        config,
        level,
        flag="compilation_config",
        level_source=f"optimization_level={level}",
    )
    return apply_compilation_request(request, kwargs)


# -- helpers ------------------------------------------------------------------------------------


def _compile_asked(given: dict[str, Any], flag: str) -> Asked | None:
    """``mode`` (or its older name ``level``): compile or not; both given must agree."""
    modes = {key: _compile_mode(given[key], key, flag) for key in ("mode", "level") if key in given}
    if len(set(modes.values())) > 1:
        raise ValueError(
            f"{flag}: mode {given['mode']!r} and level {given['level']!r} disagree (level is "
            "vLLM's older name of mode); give mode"
        )
    if not modes:
        return None
    key = "mode" if "mode" in modes else "level"
    return Asked(modes[key] > 0, _source(flag, key, given[key]))


def _compile_mode(value: Any, key: str, flag: str) -> int:
    """A ``mode``/``level`` value as vLLM takes it: 0-3 or a ``CompilationMode`` name."""
    if isinstance(value, str):
        name = value.strip().upper()
        if name in COMPILATION_MODES:
            return COMPILATION_MODES[name]
        if name.isdigit():
            value = int(name)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    raise ValueError(
        f"{flag}: {key} must be 0, 1, 2, 3 or one of {', '.join(COMPILATION_MODES)}; got {value!r}"
    )


def _sizes_asked(given: dict[str, Any], flag: str) -> Asked | None:
    """``cudagraph_capture_sizes`` and ``max_cudagraph_capture_size`` as ``cuda_graph_sizes``
    (``[]``: no graphs)."""
    sizes = given.get("cudagraph_capture_sizes")
    largest = given.get("max_cudagraph_capture_size")
    if largest is not None and (
        isinstance(largest, bool) or not isinstance(largest, int) or largest < 1
    ):
        raise ValueError(
            f"{flag}: max_cudagraph_capture_size must be an integer >= 1; got {largest!r} (no "
            "graphs: cudagraph_mode NONE)"
        )
    if sizes is None:
        if largest is None:
            return None
        return Asked([largest], _source(flag, "max_cudagraph_capture_size", largest))
    if not isinstance(sizes, list) or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
    ):
        raise ValueError(
            f"{flag}: cudagraph_capture_sizes must be a list of batch sizes >= 1 ([] for no "
            f"graphs); got {sizes!r}"
        )
    if largest is not None and (not sizes or max(sizes) != largest):
        raise ValueError(
            f"{flag}: max_cudagraph_capture_size {largest} must be the largest of "
            f"cudagraph_capture_sizes {sizes} (as vLLM checks); give one of them"
        )
    unique = sorted(set(sizes))
    if len(unique) == 1 and unique[0] != 1:
        # cuda_graph_sizes reads one value as the largest of its default pattern (vLLM's
        # --cuda-graph-sizes); exactly one size other than 1 has no spelling there
        raise ValueError(
            f"{flag}: cudagraph_capture_sizes {sizes} is one batch size; chassis captures "
            f"exactly the sizes listed only for two or more (one value N means 1, 2, 4, 8, "
            f"... up to N, as --cuda-graph-sizes N); list two or more sizes, or give "
            f"max_cudagraph_capture_size {unique[0]} for that pattern"
        )
    return Asked(unique, _source(flag, "cudagraph_capture_sizes", sizes))


def _source(flag: str, key: str, value: Any) -> str:
    """``--compilation-config mode=3``: the flag, key and value, for messages."""
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"{flag} {key}={shown}"


def _sizes_flag(sizes: list[int]) -> str:
    return f"--cuda-graph-sizes {' '.join(map(str, sizes))}" if sizes else "cuda_graph_sizes=[]"


def _disagree(first: str, second: str, why: str) -> ValueError:
    return ValueError(f"{first} and {second} disagree: {why}; give one")
