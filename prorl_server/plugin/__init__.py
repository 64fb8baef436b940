"""The plugin API: what a task handler package imports from the server.

- :class:`AgentHandler` (the three-stage handler base class, with its ``instance_model`` and
  ``settings_model``) and the failure types a handler raises; :func:`preparing_sandbox` around a step that
  prepares a sandbox (its failures are start failures, the system's);
- :class:`HandlerRegistry` / :func:`register_handler` (handlers also register through the
  ``prorl_server.handlers`` entry-point group; datasets through ``prorl_server.datasets``, whose loaders
  raise :class:`DatasetError`);
- named reward components (:mod:`prorl_server.rewards`): :func:`compose_reward` (the outcome plus process terms,
  weighted by the request's ``reward_weights``), the standard host-computed terms (:func:`process_terms`,
  :data:`STANDARD_TERMS`; ``eval`` awaits :func:`process_terms_async`, which computes a long text's terms off the
  event loop, as :func:`off_loop` does for a handler's own scoring of generated text) and :class:`RewardComponent`;
- :mod:`prorl_server.plugin.toolkit`: sandbox tools as agent tools and the shared tool-using agent loop
  (:func:`~prorl_server.plugin.toolkit.run_agent` with an :class:`AgentConfig`).
"""
from prorl_server.llm.agent_loop import AgentConfig
from prorl_server.datasets import DatasetError
from prorl_server.plugin.handler import (AgentHandler, HandlerSettingsError, InfrastructureError,
                                         InstanceValidationError, InvalidInstanceError, NotRegradableError)
from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError, register_handler
from prorl_server.failures import preparing_sandbox
from prorl_server.rewards import (LANGUAGE_MIXING, STANDARD_TERMS, TOOL_CALL_ERRORS, compose_reward, generated_texts,
                                  off_loop, process_terms, process_terms_async, turn_records)
from prorl_server.types import RewardComponent

__all__ = ["AgentConfig", "AgentHandler", "DatasetError", "HandlerRegistry", "HandlerSettingsError",
           "InfrastructureError", "InstanceValidationError", "InvalidInstanceError", "NotRegradableError",
           "UnknownHandlerError", "preparing_sandbox", "RewardComponent", "STANDARD_TERMS", "compose_reward",
           "process_terms", "process_terms_async", "off_loop", "LANGUAGE_MIXING", "TOOL_CALL_ERRORS",
           "generated_texts", "turn_records", "register_handler"]
