"""Handler registry: dispatch ``instance["data_source"]`` to an AgentHandler.

Handlers register in two ways: an explicit :func:`register_handler` call (module-level default registry or a
server's own), or a Python entry point in the group ``prorl_server.handlers`` (``name = module:Class``), which
lets users ship handlers in their own packages without touching the server.
"""
from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Iterable, Optional, Union

from prorl_server.plugin.handler import AgentHandler

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

    def register(self, handler: HandlerLike, name: Optional[str] = None,
                 aliases: Iterable[str] = ()) -> AgentHandler:
        """Register a handler class or instance under ``name`` (default: its ``name``) and aliases.

        Raises:
            ValueError: no name given and the handler has none.
        """
        inst = handler() if isinstance(handler, type) else handler
        key = name or inst.name
        if not key:
            raise ValueError(f"handler {inst!r} has no name")
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


default_registry = HandlerRegistry()


def register_handler(handler: HandlerLike, name: Optional[str] = None, aliases: Iterable[str] = (),
                     registry: Optional[HandlerRegistry] = None) -> AgentHandler:
    """Register a handler in ``registry`` (default: the process-wide one every new server copies)."""
    return (registry or default_registry).register(handler, name=name, aliases=aliases)
