"""The remote tier's room: KV blocks in a shared Valkey/Redis store, below the disk.

tier.py is the face the cache talks to (RemoteTier); the rest are its parts: writer.py (the
write-behind thread), url.py (valkey:// URLs), breaker.py (the circuit breaker in front of every
call), guarded_calls.py (every call made through it), inspect.py (what a store holds, read from the store). Imports the codec room and storage's
shared vocabulary, never the disk room.
"""
