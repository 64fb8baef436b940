"""Development and test helpers, never used by a running server: a tiny random model built locally
(:mod:`~prorl_server.dev.tiny_model`), a vLLM CPU server launcher (:mod:`~prorl_server.dev.vllm_launcher`) and a
fake vLLM that stands for vLLM's management endpoints in fault tests and benchmarks
(:mod:`~prorl_server.dev.fake_vllm`)."""
