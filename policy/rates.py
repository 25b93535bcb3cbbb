"""Token buckets by key, for every rate limit of the gateway: DNS queries per sandbox, broker calls per token,
failed authentications per source address, the broker's log lines. The caller reads the clock and passes it in
(the DNS server reads it once per batch of datagrams); nothing here reads a clock or holds a lock."""

from __future__ import annotations


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens, self.stamp = tokens, stamp


class TokenBuckets:
    """`rate` tokens a second for each key, at most `burst` saved up; a key never seen has a full bucket."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and a burst of at least 1")
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, _Bucket] = {}
        self._refill_time = burst / rate  # an empty bucket is full again after this long
        self._swept = float("-inf")

    def take(self, key: str, now: float) -> bool:
        """Spend one of `key`'s tokens at time `now` (monotonic seconds), if it has one."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if now - self._swept >= self._refill_time:
                self._forget_full(now)
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        elif now != bucket.stamp:  # the same instant again (one batch): nothing has refilled
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    def wait(self, key: str, now: float) -> float:
        """Seconds from `now` until `key` has a token to spend; 0 when it has one now."""
        return max(0.0, (1 - self._level(key, now)) / self.rate)

    def _level(self, key: str, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return float(self.burst)
        return min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)

    def _forget_full(self, now: float) -> None:
        # A full bucket means what a missing one does: dropping them, at most once per refill time and only when a
        # new key comes, keeps memory to the keys seen lately, however many distinct keys (addresses, tokens) come.
        self._swept = now
        self._buckets = {key: b for key, b in self._buckets.items() if self._level(key, now) < self.burst}

    def __len__(self) -> int:
        return len(self._buckets)
