"""LoRA adapters in the server: ``--lora-modules``, and the adapters served by name.

A request selects an adapter by sending its name as ``model`` (vLLM's convention); the
served model name selects the base model. :class:`LoRAAdapters` maps names to
:class:`~chassis.core.lora.request.LoRARequest` objects, each with an engine id of its own:
static adapters (``--lora-modules``) get 1, 2, ... in order, adapters loaded at run time
(``POST /v1/load_lora_adapter``, :mod:`chassis.serve.lora_routes`) the next ids. An id is
never given twice, not even after an unload: the engine keys its device slots and its
prefix-cache entries on the id, so a reused id could run (or reuse the KV of) another
adapter.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from chassis.core.lora.request import LoRARequest
from chassis.serve.env_flags import env_flag_set

#: the environment variables that turn on the load/unload routes (vLLM's, and chassis' own)
RUNTIME_UPDATING_VARIABLES = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "CHASSIS_ALLOW_RUNTIME_LORA_UPDATING",
)


def runtime_lora_updating_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """True when either of :data:`RUNTIME_UPDATING_VARIABLES` is ``1`` or ``true`` (any
    case), as vLLM reads its variable."""
    return env_flag_set(RUNTIME_UPDATING_VARIABLES, environ)


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` item: the name clients send as ``model``, the adapter folder,
    and (vLLM's JSON form) the base model it was trained for."""

    name: str
    path: str
    base_model_name: str | None = None


_JSON_KEYS = ("name", "path", "base_model_name")


def parse_lora_modules(text: str) -> list[LoRAModule]:
    """The adapters of one ``--lora-modules`` item: ``name=path``, a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (vLLM's forms) or a JSON list
    of such objects. A ``ValueError`` says what is wrong."""
    text = text.strip()
    if not text.startswith(("{", "[")):
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(
                f"invalid --lora-modules item {text!r}: use name=path or a JSON object "
                '\'{"name": "...", "path": "..."}\''
            )
        return [LoRAModule(name.strip(), path.strip())]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in --lora-modules item {text!r}: {exc}") from None
    return [
        _module_from_json(item, text) for item in (value if isinstance(value, list) else [value])
    ]


def _module_from_json(value: object, text: str) -> LoRAModule:
    if not isinstance(value, dict):
        raise ValueError(f"--lora-modules item {text!r}: each adapter must be a JSON object")
    unknown = sorted(set(value) - set(_JSON_KEYS))
    if unknown:
        raise ValueError(
            f"--lora-modules item {text!r}: unknown field(s) {', '.join(unknown)} "
            f"(known: {', '.join(_JSON_KEYS)})"
        )
    for key in _JSON_KEYS:
        field = value.get(key)
        required = key != "base_model_name"
        if (required or field is not None) and (not isinstance(field, str) or not field):
            raise ValueError(f"--lora-modules item {text!r}: {key!r} must be a non-empty string")
    return LoRAModule(value["name"], value["path"], value.get("base_model_name"))


def engine_lora_check(engine: object) -> Callable[[LoRARequest], None]:
    """The engine's adapter check (``engine.input_processor.check_lora``); for an engine
    without one, a check that refuses every adapter."""
    check = getattr(getattr(engine, "input_processor", None), "check_lora", None)
    if callable(check):
        return check

    def refuse(request: LoRARequest) -> None:
        raise ValueError(f"this engine does not run LoRA adapters ({request.lora_name!r})")

    return refuse


class AdapterNameError(ValueError):
    """A name no new adapter may take: empty, the served model's, or already served."""


class UnknownAdapterError(LookupError):
    """No adapter of that name is served (a 404 at the unload route)."""


class LoRAAdapters:
    """The adapters one server serves, by name, in the order they were added.

    :param base_model_name: the served model name (no adapter may take it)
    :param aliases: the served model's further names (``--served-model-name a b``: ``b``),
        which no adapter may take either
    :param check: refuses an adapter the engine cannot run with a ``ValueError`` (the
        engine's ``InputProcessor.check_lora``: LoRA off, bad folder, shapes or rank that do
        not fit the model); it may read files, so :meth:`load` runs it in a thread
    """

    def __init__(
        self,
        base_model_name: str,
        check: Callable[[LoRARequest], None],
        aliases: Sequence[str] = (),
    ) -> None:
        self.base_model_name = base_model_name
        self._model_names = {base_model_name, *aliases}
        self._check = check
        self._by_name: dict[str, LoRARequest] = {}
        self._last_id = 0
        #: one load at a time: two loads of one name must not both pass the name check
        self._lock = asyncio.Lock()

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> LoRARequest | None:
        """The adapter called ``name``, or ``None``."""
        return self._by_name.get(name)

    def _new_request(self, name: str, path: str) -> LoRARequest:
        """A request with a fresh id after checking the name (:class:`AdapterNameError`)."""
        if not isinstance(name, str) or not name:
            raise AdapterNameError("a LoRA adapter needs a non-empty name")
        if not isinstance(path, str) or not path:
            raise ValueError(f"LoRA adapter {name!r} needs a non-empty path")
        if name in self._model_names:
            raise AdapterNameError(
                f"LoRA adapter name {name!r} is the served model's name; choose another (the "
                "name selects the base model)"
            )
        if name in self._by_name:
            raise AdapterNameError(
                f"a LoRA adapter named {name!r} is already served "
                f"({self._by_name[name].lora_path}); unload it first or choose another name"
            )
        # An id is spent even when the check then fails: ids are never handed out twice.
        self._last_id += 1
        return LoRARequest(name, self._last_id, os.path.abspath(os.path.expanduser(path)))

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and serve the adapter at ``path`` as ``name`` (start-up);
        :class:`AdapterNameError` when the name cannot be taken, ``ValueError`` when the
        adapter is refused."""
        request = self._new_request(name, path)
        self._check(request)
        self._by_name[name] = request
        return request

    def add_module(self, module: LoRAModule) -> LoRARequest:
        """:meth:`add` for a ``--lora-modules`` item: a ``ValueError`` naming the item when
        it is refused."""
        try:
            return self.add(module.name, module.path)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None

    async def load(self, name: str, path: str) -> LoRARequest:
        """:meth:`add` at run time: the check runs in a worker thread, one load at a time."""
        async with self._lock:
            request = self._new_request(name, path)
            await asyncio.to_thread(self._check, request)
            self._by_name[name] = request
            return request

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (requests already running with it finish);
        :class:`UnknownAdapterError` when no adapter has that name."""
        request = self._by_name.pop(name, None)
        if request is None:
            raise UnknownAdapterError(f"The LoRA adapter '{name}' cannot be found.")
        return request


def check_lora_modules(
    modules: list[LoRAModule],
    *,
    enable_lora: bool,
    served_model_name: str,
    aliases: Sequence[str] = (),
) -> None:
    """Refuse ``--lora-modules`` before the model loads: without ``--enable-lora``, a name
    repeated or equal to one of the served model's names, a folder that is not a PEFT LoRA adapter
    (``adapter_config.json``). Whether the adapter fits the model is checked once the
    engine is up (:meth:`LoRAAdapters.add` with the engine's check)."""
    if not modules:
        return
    if not enable_lora:
        raise ValueError(
            "--lora-modules needs --enable-lora (LoRA is off); add --enable-lora to serve "
            "the adapters"
        )
    from chassis.core.lora.adapter import read_adapter_config

    adapters = LoRAAdapters(
        served_model_name, lambda lora: read_adapter_config(lora.lora_path), aliases
    )
    for module in modules:
        adapters.add_module(module)
