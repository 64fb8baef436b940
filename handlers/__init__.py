"""Task handlers: everything task-specific (sandbox setup, agent loop, reward) lives in an AgentHandler."""
from handlers.base import AgentHandler
from handlers.registry import HandlerRegistry, UnknownHandlerError, register_handler

__all__ = ["AgentHandler", "HandlerRegistry", "UnknownHandlerError", "register_handler"]
