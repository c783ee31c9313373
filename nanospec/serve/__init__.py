"""An OpenAI-compatible server over one ``LLM``: ``python -m nanospec.serve`` (FastAPI + uvicorn).

    __main__.py     the command line: load the model, build the app, run uvicorn (127.0.0.1:8000 by default)
    app.py          the routes, one request top to bottom: auth, body, checks, submit, stream or answer, abort
    protocol.py     the request bodies (pydantic), and their sampling fields as SamplingParams
    engine_loop.py  the one thread that steps the engine; requests join and leave between steps
    responses.py    OpenAI's response, chunk, log-prob, usage and error shapes
    metrics.py      Prometheus metrics with vLLM's names (/metrics)

``build_app(llm, model_name=...)`` (in app.py) gives the ASGI app for any ASGI server.
"""
