"""The codec's room: how a block's bytes are stored, in every tier below the host.

payload.py is the payload format (a versioned, checked header and a zstd frame per byte plane);
byte_planes.py splits a tensor's bytes into planes by significance and joins them back.
Imports only storage's shared vocabulary (layout, hashing).
"""
