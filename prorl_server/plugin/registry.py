"""Handler registry: dispatch ``instance["data_source"]`` to an AgentHandler.

Handlers register in two ways: an explicit :func:`register_handler` call (module-level default registry or a
server's own), or a Python entry point in the group ``prorl_server.handlers`` (``name = module:Class``), which
lets users ship handlers in their own packages without touching the server.

:meth:`HandlerRegistry.configure` hands each handler its settings (``handler.settings``), validated against
its ``settings_model``, from the server settings' ``handlers: {<name>: {...}}`` section.
"""
from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any, Iterable, Mapping, Optional, Union

from pydantic import ValidationError

from prorl_server.plugin.handler import AgentHandler, HandlerSettingsError, error_location

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "prorl_server.handlers"


class UnknownHandlerError(KeyError):
    """``data_source`` names no registered handler. ``known`` lists the names that do exist."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown handler {self.name!r}; known handlers: {', '.join(self.known) or '(none)'}"


HandlerLike = Union[AgentHandler, type[AgentHandler]]


class HandlerRegistry:
    """Maps names and aliases to handler instances (one instance per handler, shared by all its jobs)."""

    def __init__(self) -> None:
        self._handlers: dict[str, AgentHandler] = {}
        self._aliases: dict[str, str] = {}
        self._configured: set[str] = set()  # handlers whose settings the last configure() set

    def register(self, handler: HandlerLike, name: Optional[str] = None,
                 aliases: Iterable[str] = ()) -> AgentHandler:
        """Register a handler class or instance under ``name`` (default: its ``name``) and aliases.

        Raises:
            ValueError: no name given and the handler has none, or its ``reward_terms`` are not distinct
                lower-case identifiers other than ``outcome`` (at most 31: ``MAX_REWARD_COMPONENTS`` with it).
        """
        import re

        from prorl_server.types import MAX_REWARD_COMPONENTS, REWARD_COMPONENT_PATTERN

        inst = handler() if isinstance(handler, type) else handler
        key = name or inst.name
        if not key:
            raise ValueError(f"handler {inst!r} has no name")
        terms = tuple(getattr(inst, "reward_terms", ()))
        bad = [t for t in terms if not isinstance(t, str) or not re.fullmatch(REWARD_COMPONENT_PATTERN, t)
               or t in ("outcome", "speed")]  # the server's own components (prorl_server.rewards)
        if bad or len(set(terms)) != len(terms) or len(terms) >= MAX_REWARD_COMPONENTS:
            raise ValueError(f"handler {key!r}: reward_terms {terms!r} must be distinct lower-case identifiers other "
                             f"than 'outcome' and 'speed', at most {MAX_REWARD_COMPONENTS - 1} (bad: {bad!r})")
        self._handlers[key] = inst
        for alias in (*inst.aliases, *aliases):
            self._aliases[alias] = key
        return inst

    def load_entry_points(self) -> list[str]:
        """Register every handler advertised in the ``prorl_server.handlers`` entry-point group.
        A handler that fails to import is logged and skipped. Returns the names registered."""
        loaded = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._handlers:
                continue
            try:
                self.register(ep.load(), name=ep.name)
                loaded.append(ep.name)
            except Exception:
                log.exception("could not load handler entry point %s = %s", ep.name, ep.value)
        return loaded

    def resolve(self, name: str) -> tuple[str, AgentHandler]:
        """Return ``(canonical_name, handler)`` for a name or alias.

        Raises:
            UnknownHandlerError: nothing registered under ``name``.
        """
        key = self._aliases.get(name, name)
        h = self._handlers.get(key)
        if h is None:
            raise UnknownHandlerError(name, self.names())
        return key, h

    def names(self) -> list[str]:
        return sorted({*self._handlers, *self._aliases})

    def configure(self, sections: Mapping[str, Mapping[str, Any]]) -> None:
        """Hand each handler named in ``sections`` (by name or alias) its settings: the section validated
        against the handler's ``settings_model``. A handler that an earlier call configured and this one does
        not name goes back to its model's defaults; any other keeps its own (e.g. from its constructor).

        Raises:
            HandlerSettingsError: a section names no registered handler, is given to a handler without a
                ``settings_model``, has a key the model does not know, or a bad value. Nothing is changed
                then.
        """
        chosen: dict[str, Any] = {}
        for key, section in sections.items():
            try:
                name, handler = self.resolve(key)
            except KeyError:
                raise HandlerSettingsError(f"handlers.{key}: no such handler; known handlers: "
                                           f"{', '.join(self.names()) or '(none)'}") from None
            model = handler.settings_model
            if model is None:
                raise HandlerSettingsError(f"handlers.{key}: the {name} handler takes no settings")
            if not isinstance(section, Mapping):
                raise HandlerSettingsError(f"handlers.{key}: must be a mapping of settings")
            unknown = sorted(set(section) - set(model.model_fields))
            if unknown:
                raise HandlerSettingsError(f"handlers.{key}: unknown setting(s) {unknown}; the {name} handler "
                                           f"has {sorted(model.model_fields)}")
            try:
                chosen[name] = model.model_validate(dict(section))
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                raise HandlerSettingsError(f"{error_location(err, f'handlers.{key}')}: {err['msg']}") from None
        for name in self._configured - set(chosen):
            handler = self._handlers[name]
            handler.settings = handler.settings_model() if handler.settings_model is not None else None
        for name, value in chosen.items():
            self._handlers[name].settings = value
        self._configured = set(chosen)


default_registry = HandlerRegistry()


def register_handler(handler: HandlerLike, name: Optional[str] = None, aliases: Iterable[str] = (),
                     registry: Optional[HandlerRegistry] = None) -> AgentHandler:
    """Register a handler in ``registry`` (default: the process-wide one every new server copies)."""
    return (registry or default_registry).register(handler, name=name, aliases=aliases)
