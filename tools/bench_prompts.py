"""The prompts the benchmarks share: real prose tiled to any length, and the suffix length.

Knows: a passage of real prose (written for these benchmarks) and how to take n token ids of it,
tiled, from any offset -- KV of natural text is what the codec and the attention see in
production, not random ids -- and the 16-token suffix every TTFT request adds (always computed,
so only the prefix can hit). Doesn't know: tiers, engines or timing.
"""
from __future__ import annotations

SUFFIX_TOKENS = 16

# Real prose (written for this benchmark), tiled to the prefix length: KV of natural text is
# what the codec and the attention see in production, not random ids.
PROSE = """\
The lighthouse on the northern point was built in the spring of a dry year, when the river
that usually flooded the lower fields barely reached its banks. The builders carried stone
from a quarry two valleys away, and every cart that came down the hill road was counted by
the children of the village, who had never seen so much work done in one place. By midsummer
the tower stood taller than the church, and the keeper who would live in it arrived with a
trunk of books, a clock that had to be wound every evening, and a dog that refused to climb
the stairs.

For the first few winters the light was fed with oil, and the keeper's days followed the
same order: trim the wicks at noon, polish the lens in the afternoon, light the lamp before
the sun touched the water, and write the weather into the log every four hours through the
night. The log survives. It is mostly wind directions and the names of ships, but here and
there the keeper wrote a sentence about something else: a heron standing on the rocks for a
whole day, a storm that pulled the roof off the boat shed, a letter that came too late.

Fishermen say that a light is only noticed when it fails. On the night of the great fog the
lamp burned as it always did, but nobody at sea could see it, and the keeper went down to the
shore with a bell and rang it until his arms gave out. In the morning every boat was home.
The village paid for a proper fog signal the next year, a horn driven by compressed air, and
people who grew up within earshot of it still claim they cannot fall asleep in silence.

Electricity reached the point much later than it reached the town. The cable was laid along
the old cart road, and the day the lamp was switched over, the keeper's daughter, who by then
kept the light herself, wrote in the log that the tower felt empty without the smell of oil.
The lens stayed the same. It had been ground by hand, in a workshop that no longer exists, and
engineers who came to inspect it said that nothing made today would focus the beam as well.

Today the light is automatic. A small computer in a grey cabinet turns it on at dusk, reports
its own faults over a telephone line, and has never once written a sentence about a heron.
The keeper's cottage is a museum, open on weekends in summer, where visitors can read the log
under glass and climb the stairs that the dog would not. From the gallery at the top you can
see the river, the fields it still floods in wet years, and on a clear day the grey line of
the far coast, which the light was built to warn ships away from and which none of the
keepers ever visited.
"""


_PROSE_IDS: dict[int, list[int]] = {}


def prose_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    """n token ids of PROSE, tiled, starting `offset` tokens in."""
    base = _PROSE_IDS.get(id(tokenizer))
    if base is None:
        base = _PROSE_IDS[id(tokenizer)] = list(tokenizer(PROSE)["input_ids"])
    reps = (offset + n) // len(base) + 1
    return (base * reps)[offset:offset + n]
