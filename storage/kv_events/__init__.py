"""KV events: what this server caches, published in vLLM's wire format (ZMQ PUB + a replay ROUTER,
msgpack via msgspec), so routers built for vLLM (llm-d, NVIDIA Dynamo) and `tieredkv route` can
send a request where its prefix already sits.

wire.py: the structs, declared exactly as vLLM declares them. endpoints.py: what an endpoint may
look like, and the replay endpoint's default. sink.py: the hook the tiers call (a bounded queue;
a no-op when events are off). publisher.py: the thread that batches, encodes, sends and replays.
access.py: who may subscribe (CURVE keys on tcp, a private directory for ipc); keys.py: the key files.

NOTE: this module imports nothing: the tiers below the host import sink.py only (no zmq, no msgspec).
"""
