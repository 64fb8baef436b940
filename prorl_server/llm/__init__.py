"""The token path: everything between a handler's messages and a backend's token ids.

- :mod:`~prorl_server.llm.client`: the token-in/token-out LLM client over the backend pool (retries, sticky
  routing, weight versions per token);
- :mod:`~prorl_server.llm.conversation`: a multi-turn conversation kept as exact token ids (the handler API);
- :mod:`~prorl_server.llm.turn`: one turn (render, generate, parse) for jobs and the gateway alike;
- :mod:`~prorl_server.llm.tool_parser`: vLLM's tool parsers, bounded;
- :mod:`~prorl_server.llm.chat_templates`: the model families' published chat templates;
- :mod:`~prorl_server.llm.context`: what a job's LLM calls share (client, tokenizer, served model);
- :mod:`~prorl_server.llm.agent_loop`: the shared tool-using agent loop (public through
  :mod:`prorl_server.plugin.toolkit`).

Nothing here knows about jobs' pipeline stages, sandboxes or HTTP routes of the server.
"""
