"""The codec's room: how a block's bytes are stored, in every tier below the host.

header.py is the payload's versioned, checked header; payload.py the codec (a zstd frame per byte plane);
byte_planes.py splits a tensor's bytes into planes by significance and joins them back.
Imports only storage's shared vocabulary (layout, hashing).
"""
