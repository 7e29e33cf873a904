"""`tieredkv route`: an OpenAI-compatible front of several tieredkv servers that sends each request
to the server already holding its prompt's prefix, weighed against that server's load.

One concept per file:

    events.py      vLLM's KV-event wire format, decoded (and encoded, for tests and tools)
    index.py       block hash -> {backend: the media holding it}, plus routing-time predictions
    subscriber.py  one backend's event stream: ZMQ SUB, sequence gaps filled by replay
    backends.py    the backend set: health checks, in-flight counts, a subscriber per backend
    ejection.py    passive health: ejected by real answers, readmitted by a probe after a cool-down
    policy.py      which backend gets a request: longest weighted prefix against load
    answers.py     what a backend's answer must look like (bodies, error objects, SSE events)
    relay.py       one answer judged before the client sees a byte, then relayed event by event
    proxy.py       forwarding one request (retries, and ejects, before any byte is sent)
    metrics.py     /metrics of the router
    settings.py    RouterSettings: the knobs, validated
    app.py         the FastAPI app: routes, lifespan
    server.py      uvicorn with a clean exit on SIGTERM (its connections under service/read_limits.py)

Knows: HTTP, ZMQ and the events' format; imports nothing of the engine (no torch).
Doesn't know: how a backend computes block hashes -- it asks one (/v1/cache/block_hashes).
"""
