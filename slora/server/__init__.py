"""`slora serve`: an OpenAI- and LoRAX-compatible HTTP server over one AsyncEngine.

The stable entry points (other tools build on them):

    from slora.server.app import build_app            # build_app(async_engine, settings) -> FastAPI
    from slora.server.settings import ServerSettings  # model name, adapter dir, key, limits
    from slora.server.testing import serve_in_thread  # uvicorn in a thread on a free port

    engine = AsyncEngine(EngineConfig(model=...))
    with serve_in_thread(build_app(engine, ServerSettings(model_name="base"))) as live:
        ...                                            # requests to live.url
    engine.shutdown()

Modules: app (the app, the front door, draining), openai_api and lorax_api (the routes),
protocol (their request bodies), generation (one HTTP request's engine requests), state
(what the handlers share), adapters (resolver, confinement, runtime loads), metrics
(Prometheus), settings (ServerSettings, the engine's flags), errors (OpenAI's error shape),
serve (the command), testing (serve_in_thread). This package's __init__ imports nothing, so
`slora --help` stays fast.
"""
