"""A Bloom filter of recently added keys: "has this key been seen lately?"

Used by the ``2q`` and ``arcdk`` eviction policies to remember keys for
several tier capacities at ~6 bytes per key, where a ghost list would keep
the keys themselves. Pure Python, O(1) per call, not thread-safe (like the
policy and the tier that own it: their caller serializes calls).
"""

from __future__ import annotations

from collections.abc import Hashable

from xxhash import xxh3_64_intdigest

_M64 = (1 << 64) - 1
_MIX1 = 0x9E3779B97F4A7C15  # odd 64-bit constants (Fibonacci hashing)
_MIX2 = 0xC2B2AE3D27D4EB4F


class Doorkeeper:
    """Has this key been seen among the last ``window`` to ``2 * window``
    keys added? A Bloom filter (two bits per key, 16 bits of filter per
    key of window, so ~1 % false positives) in two generations: the current
    one takes new keys, the previous one is still asked, and after
    ``window`` additions the previous is dropped. Never a false negative
    within the window. O(1), the change of generation included: a third
    generation, the next one, is zeroed a few bytes per addition, so that it
    is empty when its turn comes and a change of generation only swaps them
    (making a new one there zero-filled ``window`` x 2 to 4 bytes inside one
    store or spill, a pause that grows with the tier). 6 bytes per key of
    window whatever the keys are.

    ``hash(key)`` is mixed by two multiplications, so keys whose hashes
    are sequential (the integer block ids of a trace) collide as often as
    real block hashes do: ``kvtier size`` then predicts what the plugin gets.
    A ``bytes`` key (vLLM's ``OffloadKey``) is hashed with xxh3, not
    ``hash()``, which Python salts per process: the same keys give the same
    false positives, hence the same evictions, in every run.
    """

    def __init__(self, window: int):
        self.window = max(64, window)
        self._bits = (16 * self.window - 1).bit_length()  # >= 16 bits per key
        self._shift = 64 - self._bits
        self._nbytes = (1 << self._bits) // 8
        self._cur = bytearray(self._nbytes)
        self._prev = bytearray(self._nbytes)
        # The next generation, and how many of its bytes are zero from the
        # start (all of it: it is new). Each addition zeroes ``_step`` more,
        # so it is all zero after ``window`` additions, when it is needed: a
        # power of two, so the steps tile the (power-of-two) generation.
        self._next = bytearray(self._nbytes)
        self._zeroed = self._nbytes
        self._step = 1 << (-(-self._nbytes // self.window) - 1).bit_length()
        self._zeros = bytes(self._step)
        self._added = 0

    def _index(self, key: Hashable) -> tuple[int, int, int, int]:
        h = xxh3_64_intdigest(key) if type(key) is bytes else hash(key)
        a = ((h * _MIX1) & _M64) >> self._shift
        b = ((h * _MIX2) & _M64) >> self._shift
        return a >> 3, 1 << (a & 7), b >> 3, 1 << (b & 7)

    def __contains__(self, key: Hashable) -> bool:
        ia, ma, ib, mb = self._index(key)
        cur, prev = self._cur, self._prev
        return bool(
            (cur[ia] & ma and cur[ib] & mb) or (prev[ia] & ma and prev[ib] & mb)
        )

    def add(self, key: Hashable) -> bool:
        """Remember ``key``; returns whether it was already remembered."""
        ia, ma, ib, mb = self._index(key)
        cur, prev = self._cur, self._prev
        seen = bool(
            (cur[ia] & ma and cur[ib] & mb) or (prev[ia] & ma and prev[ib] & mb)
        )
        cur[ia] |= ma
        cur[ib] |= mb
        zeroed = self._zeroed
        if zeroed < self._nbytes:
            self._zeroed = end = zeroed + self._step
            self._next[zeroed:end] = self._zeros
        self._added += 1
        if self._added >= self.window:
            # The oldest generation is zeroed from now on, to be the next.
            self._prev, self._cur, self._next = cur, self._next, prev
            self._added = self._zeroed = 0
        return seen
