"""The way in and out over HTTP: the gateway (auth, rate limits, validation, admission) and the
OpenAI-compatible server (one engine thread, SSE streaming, traces)."""
