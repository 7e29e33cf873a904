"""The fault drill's damage to a copied store: where a bit flip lands on a page of a given kind
(a header field or the used bytes; tools/lmdb_pages.py labels the pages), the flip itself, a
truncation, payloads rotated among keys, and the flips planned evenly over the page kinds.
Knows nothing of running a trial or counting its outcome.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb

# -- damage -----------------------------------------------------------------------------------

def aim(pm, data: bytes, kind: str, pgno: int, rng: random.Random, header_bias: float) -> tuple[int, str]:
    """(offset in the file, field) of the byte to hit on page `pgno` of `kind`."""
    ps = pm.page_size
    base = pgno * ps
    header = rng.random() < header_bias

    def pick(field: str, lo: int, hi: int) -> tuple[int, str]:
        return base + rng.randrange(lo, max(lo + 1, hi)), field
    if kind.startswith("metapage"):
        if header:
            return pick(*rng.choice([("pgno", 0, 8), ("flags", 10, 12), ("meta_dbs", 40, 136),
                                     ("meta_last_pg_txnid", 136, 152)]))
        return pick("meta", 16, 152)
    if kind.endswith("ovf_cont"):
        return pick("data", 0, ps)
    if kind.endswith("ovf_head"):
        if header:
            return pick(*rng.choice([("pgno", 0, 8), ("flags", 10, 12), ("ovf_count", 12, 16)]))
        return pick("data", 16, ps)
    if kind.endswith("_branch") or kind.endswith("_leaf"):
        lower, upper = int.from_bytes(data[base + 12:base + 14], "little"), int.from_bytes(data[base + 14:base + 16], "little")
        offsets = [int.from_bytes(data[base + o:base + o + 2], "little") for o in range(16, lower, 2)]
        if header or upper >= ps:
            field = rng.choice(["pgno", "flags", "lower_upper", "node_offsets", "node_header"])
            if field == "node_offsets" and lower > 16:
                return pick(field, 16, lower)
            if field == "node_header" and offsets:
                off = rng.choice(offsets)
                return pick(field, off, min(off + 8, ps))
            return pick(*{"pgno": ("pgno", 0, 8), "flags": ("flags", 10, 12)}.get(field, ("lower_upper", 12, 16)))
        return pick("nodes", upper, ps)
    return pick("any", 0, ps)    # free-listed or orphan pages: stale bytes


def flip_at(path: Path, at: int, bit: int) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << bit)]))


def truncate(path: Path, rng: random.Random) -> None:
    data = path / "data.mdb"
    os.truncate(data, rng.randrange(os.path.getsize(data)))


def swap_payloads(path: Path, rng: random.Random) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            keys = [k for k, _ in txn.cursor(db=db)]
            picked = rng.sample(keys, min(len(keys), 8))
            vals = [bytes(txn.get(k, db=db)) for k in picked]
            for k, v in zip(picked, vals[1:] + vals[:1]):
                txn.put(k, v, db=db)
    finally:
        env.close()


# -- trials and their tally -------------------------------------------------------------------

def plan_flips(base: Path, total: int, header_bias: float, rng: random.Random, only: str = ""
               ) -> tuple[list[dict], dict]:
    """`total` bit flips spread evenly over the page kinds the store has (or those in `only`)."""
    from lmdb_pages import classify
    pm = classify(str(base))
    data = (base / "data.mdb").read_bytes()
    wanted = set(filter(None, only.split(",")))
    kinds = {k: v for k, v in pm.by_kind().items() if k != "orphan" and (not wanted or k in wanted)}
    names = sorted(kinds)
    plans = []
    for j, kind in enumerate(names):
        for _ in range(total // len(names) + (j < total % len(names))):
            pgno = rng.choice(kinds[kind])
            at, field = aim(pm, data, kind, pgno, rng, header_bias)
            plans.append({"group": kind, "damage": "flip", "pgno": pgno, "at": at, "offset": at - pgno * pm.page_size,
                          "bit": rng.randrange(8), "field": field})
    return plans, {k: len(v) for k, v in sorted(pm.by_kind().items())}
