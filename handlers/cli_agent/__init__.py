"""``cli_agent``: train any program that speaks the OpenAI Chat Completions API. See README.md here."""
from handlers.cli_agent.handler import CliAgentHandler

__all__ = ["CliAgentHandler"]
