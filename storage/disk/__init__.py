"""The disk tier's room: compressed KV blocks in an LMDB environment on this machine.

tier.py is the face the cache talks to (DiskTier); the rest are its parts: records.py (the
databases and their record formats), writer.py (the background writer), integrity.py (verify and
audit), preflight.py and pagewalk.py (a damaged environment found before LMDB maps it), index.py
(the stored hashes in memory). Imports the codec room and storage's shared vocabulary, never
the remote room.
"""
