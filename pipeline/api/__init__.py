"""`rqllm serve`: an OpenAI-compatible HTTP API (Files, Batches, chat/completions, models) in front of the queue.

    app.py          the FastAPI app factory and its lifespan (connections, batch runners)
    config.py       ServeConfig: limits, keys, data directory
    auth.py         Bearer keys -> owner ids; loopback-only without keys
    limits.py       request body size limit (413)
    errors.py       OpenAI's error shape for every error
    schemas.py      the API's pydantic objects (file, batch, lists)
    records.py      pydantic records as Redis hashes; cursor pages
    state.py        what endpoints reach through the app (stores, queue client, runners)
    files.py        FileStore: bytes on disk (atomic writes), metadata in Redis
    batches.py      BatchStore: API batch records in Redis
    batch_runner.py one thread per batch: validate + submit, collect, finalize
    batch_output.py the output and error files of a finished batch
    completions.py  /v1/chat/completions and /v1/completions: a high-priority job, SSE from its token stream
    routes_*.py     the endpoints
    serve.py        process set-up: embedded Redis + workers or REDIS_URL, then uvicorn
"""
