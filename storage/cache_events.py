"""The cache's KV events: the publisher started with its sink handed to every tier, and what the
tiers below held at start announced, so a router learns what a restarted server can serve.

Knows: starting the publisher (storage/kv_events/publisher.py: zmq and msgspec, imported only
when events are on), giving its sink to the tiers' hook and to each tier below (they say their
own changes), the announcing thread (`tieredkv-kv-events-announce`) and the stream's status.
A part of TieredKVCache (a base class of it: `config`, `layout`, `tiers`, `_lock`, `_closing`,
`events_publisher` and `_announcer` are the cache's; its close() joins the announcer and closes
the publisher).
Doesn't know: which tiers are below (it walks `Tiers.lower`: LowerTier.iter_blocks/announce),
or when a block becomes findable (each tier says so at its index's mutations).
"""
from __future__ import annotations

import logging
import threading

from storage.hashing import BlockKey
from storage.kv_events.sink import EventSink

log = logging.getLogger(__name__)


class CacheEvents:
    def _publish_events(self) -> None:
        """Start the KV-event publisher (storage/kv_events/) and give every tier its sink. Its
        first batch is AllBlocksCleared; then the blocks this process's own tiers below already
        held (the disk's) are announced (BlockStored DISK) by a thread reading them: a router
        learns what a restarted server can serve."""
        from storage.kv_events.access import prepare                # zmq, msgspec: only when on
        from storage.kv_events.publisher import KVEventPublisher
        c = self.config
        sink, access = EventSink(), prepare(c)
        self.events_publisher = KVEventPublisher(sink, c.kv_events, c.kv_events_replay_endpoint,
                                                 block_size=self.layout.block_size, access=access,
                                                 topic=c.kv_events_topic, tokens=c.kv_events_tokens,
                                                 replay_s=c.kv_events_replay_s)
        with self._lock:
            self.tiers.publish_to(sink)
        p = self.events_publisher
        log.info("kv events: publishing on %s (replay %s; %s)", p.endpoint, p.replay_endpoint,
                 f"CURVE, {len(access.allowed)} subscriber key(s) allowed" if access.curve else "a private socket")
        if any(below.local for below in self.tiers.lower):
            self._announcer = threading.Thread(target=self._announce_held, args=(sink,),
                                               name="tieredkv-kv-events-announce", daemon=True)
            self._announcer.start()

    def _announce_held(self, sink: EventSink) -> None:
        """The blocks held below at start (LowerTier.iter_blocks: the disk's; a store lists none)
        as BlockStored, a chunk at a time, never more than a quarter of the sink's queue ahead of
        the publisher (live events keep their room).
        NOTE: a tier announces only what it still holds, under the lock its removals are said
        under, so an eviction racing the scan never leaves a router believing in a gone block."""
        for below in self.tiers.lower:
            try:
                chunk: list[BlockKey] = []
                for b in below.iter_blocks():
                    if self._closing.is_set():
                        return
                    chunk.append(BlockKey(b.hash, b.parent, tuple(b.token_ids), b.namespace))
                    if len(chunk) == 256:
                        while sink.busy() and not self._closing.wait(0.01):
                            pass
                        below.announce(chunk)
                        chunk = []
                below.announce(chunk)
            except Exception:
                log.exception("kv events: announcing the %s tier's blocks failed; routers learn them as they move",
                              below.name)

    def events_status(self) -> dict:
        """The KV-event stream, for cache status: where it is bound (a router subscribes there),
        its last sequence number and the events dropped for a full queue; {"enabled": False} off."""
        p = self.events_publisher
        return {"enabled": False} if p is None else p.status()
