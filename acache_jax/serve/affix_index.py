"""Online affix discovery: find token spans that recur across requests and keep their affix caches.

Texts are cut at boundaries they already have (after each line break, before each special token
such as a chat turn's role marker) and every piece is tokenized alone, so a span of whole pieces
has the same token ids in every request that contains it, wherever it sits. `SpanIndex` counts,
per request, every run of consecutive pieces that is long enough to pay (hashed at token level:
a polynomial hash of the run's ids and its length, O(1) per run from prefix hashes); once a run has
been seen `min_count` times it qualifies, and the request is served with the longest qualifying
run as its affix (one affix per request: the engine reads at most one shared set per request).
`AffixStore` keeps the built affix caches under a byte budget, least recently used first out,
and never evicts a cache that a queued or running request holds.

A hash collision can only miscount a run: the cache is keyed and built by the run's actual ids.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from acache_jax.network.kv import AffixCache

_MOD = (1 << 61) - 1  # a Mersenne prime: the hash of a run fits 61 bits
_BASE = 1_000_003
MAX_RUN = 64  # pieces per counted run: bounds the work per request at (pieces x MAX_RUN)


def split_text(text: str, specials: Iterable[str] = ()) -> list[str]:
    """The text cut after every line break and before every special token; concatenated they give
    the text back, and split_text(a + b) == split_text(a) + split_text(b) when a ends with a line
    break or b starts with a special token (so a span declared by hand splits as it does inside a
    whole prompt)."""
    marks = sorted((s for s in specials if s), key=len, reverse=True)
    pattern = "\n" if not marks else "\n|(?=" + "|".join(map(re.escape, marks)) + ")"
    pieces, start = [], 0
    for m in re.finditer(pattern, text):
        end = m.end()
        if end > start:
            pieces.append(text[start:end])
            start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces


@dataclasses.dataclass(frozen=True)
class Span:
    """A run of whole pieces of a request: pieces [start, stop), as token ids."""

    start: int
    stop: int
    ids: tuple[int, ...]


class SpanIndex:
    """Counts runs of pieces across requests (see the module docstring).

    A server sees new runs with almost every request, so the counts are bounded: beyond
    `max_entries` the runs seen least recently are forgotten (about 195 bytes each: 39 MB at the
    default 200k, which a server reaches and then holds)."""

    def __init__(self, min_count: int = 2, min_tokens: int = 64, max_entries: int = 200_000):
        if min_count < 1 or min_tokens < 1 or max_entries < 1:
            raise ValueError("min_count, min_tokens and max_entries must be positive")
        self.min_count, self.min_tokens, self.max_entries = min_count, min_tokens, max_entries
        self._counts: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) -> requests seen in

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, pieces: list[list[int]]) -> Span | None:
        """Count this request's runs; its longest run that qualifies (seen in min_count requests,
        this one included) and leaves at least one piece after it (a prefix needs a prompt after
        it, an infix a tail). None if no run qualifies."""
        offsets = [0]
        for p in pieces:
            offsets.append(offsets[-1] + len(p))
        ids = [t for p in pieces for t in p]
        prefix, power = [0], [1]
        for t in ids:
            prefix.append((prefix[-1] * _BASE + t + 1) % _MOD)
            power.append(power[-1] * _BASE % _MOD)
        seen: set[tuple[int, int]] = set()
        best: tuple[int, int] | None = None
        n = len(pieces)
        for i in range(n - 1):
            for j in range(i + 1, min(n - 1, i + MAX_RUN) + 1):
                a, b = offsets[i], offsets[j]
                if b - a < self.min_tokens:
                    continue
                key = (b - a, (prefix[b] - prefix[a] * power[b - a]) % _MOD)
                if key in seen:
                    continue
                seen.add(key)
                count = self._counts.pop(key, 0) + 1
                self._counts[key] = count  # most recently seen last
                if count >= self.min_count and (best is None or b - a > offsets[best[1]] - offsets[best[0]]):
                    best = (i, j)
        while len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        if best is None:
            return None
        i, j = best
        return Span(i, j, tuple(ids[offsets[i]:offsets[j]]))


def cache_bytes(cache: AffixCache) -> int:
    return sum(a.size * a.dtype.itemsize for a in (*cache.k, *cache.v))


@dataclasses.dataclass
class _Entry:
    cache: AffixCache
    nbytes: int
    holds: int = 0  # queued and running requests that use it


class AffixStore:
    """Built affix caches by key under a byte budget; LRU eviction of caches no request holds."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def hold(self, key: Hashable) -> AffixCache | None:
        """The cache of `key`, held for one more request (None if absent)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        entry.holds += 1
        return entry.cache

    def release(self, key: Hashable) -> None:
        entry = self._entries[key]
        assert entry.holds > 0, f"affix {key!r:.40} released more often than held"
        entry.holds -= 1

    def drop_unheld(self) -> None:
        for key in [k for k, e in self._entries.items() if not e.holds]:
            del self._entries[key]

    def add(self, key: Hashable, cache: AffixCache) -> bool:
        """Store a cache (not held yet), evicting unheld ones least recently used first to make room;
        False, and nothing evicted, if it cannot fit beside the held ones."""
        assert key not in self._entries, "added twice"
        nbytes = cache_bytes(cache)
        free = self.budget_bytes - sum(e.nbytes for e in self._entries.values() if e.holds)
        if nbytes > free:
            return False
        while self.nbytes + nbytes > self.budget_bytes:
            victim = next(k for k, e in self._entries.items() if not e.holds)
            del self._entries[victim]
            self.evictions += 1
        self._entries[key] = _Entry(cache, nbytes)
        return True
