"""The way in and out over HTTP, in the order a request meets it:

    server (uvicorn, ServerThread, serve) → app (routes) → gateway (auth, rate limits,
    validation, admission) → state (the model, traces, steps) → engine_loop (the one engine
    thread) → responses (OpenAI's shapes, SSE, the `sent` stamps); config holds the options.
"""
