"""The block codec's one error: a payload that is damaged or not the one asked for.

Knows nothing else; raised by storage/codec/header.py (the container's header),
storage/codec/payload.py (the codec) and storage/codec/zstd_frames.py (the frames inside it), caught by every tier's read as a miss.
"""


class CodecError(Exception):
    """A payload is damaged or not ours: bad magic/version/crc, truncated, zstd failure, size mismatch."""
