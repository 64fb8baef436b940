"""The plugin API: what a task handler package imports from the server.

- :class:`AgentHandler` (the three-stage handler base class) and the failure types a handler raises;
- :class:`HandlerRegistry` / :func:`register_handler` (handlers also register through the
  ``prorl_server.handlers`` entry-point group);
- :mod:`prorl_server.plugin.toolkit`: sandbox tools as agent tools and the shared tool-using agent loop.
"""
from prorl_server.plugin.handler import AgentHandler, InfrastructureError, InvalidInstanceError
from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError, register_handler

__all__ = ["AgentHandler", "HandlerRegistry", "InfrastructureError", "InvalidInstanceError",
           "UnknownHandlerError", "register_handler"]
