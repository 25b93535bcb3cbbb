"""The one token-bucket implementation (airlock.policy.rates) behind every rate limit: DNS per sandbox, broker calls
per token, failed authentications per address, the broker's log lines."""

from __future__ import annotations

import pytest

from airlock.policy import TokenBuckets


def test_a_new_key_has_a_full_bucket_and_refills_at_the_rate() -> None:
    buckets = TokenBuckets(rate=2.0, burst=3)
    assert [buckets.take("a", 100.0) for _ in range(4)] == [True, True, True, False]
    assert buckets.take("b", 100.0)  # every key has its own bucket
    assert not buckets.take("a", 100.4) and buckets.take("a", 100.5)  # one token per 0.5 s
    assert [buckets.take("a", 110.0) for _ in range(4)] == [True, True, True, False]  # never more than the burst


def test_the_same_instant_again_refills_nothing() -> None:
    # The DNS server reads the clock once per batch of datagrams: every query of the batch passes the same `now`.
    buckets = TokenBuckets(rate=1000.0, burst=2)
    assert [buckets.take("sbx", 5.0) for _ in range(3)] == [True, True, False]


def test_wait_says_how_long_until_a_token() -> None:
    buckets = TokenBuckets(rate=4.0, burst=1)
    assert buckets.wait("x", 0.0) == 0.0
    assert buckets.take("x", 0.0)
    assert buckets.wait("x", 0.0) == pytest.approx(0.25) and buckets.wait("x", 0.125) == pytest.approx(0.125)


def test_only_refilled_buckets_are_forgotten() -> None:
    buckets = TokenBuckets(rate=1.0, burst=3)  # an empty bucket is full again after 3 s
    for n in range(100):
        assert buckets.take(f"10.0.0.{n}", 1000.0)
    assert all(buckets.take("busy", 1002.5) for _ in range(3))
    assert buckets.take("new", 1003.0)
    assert len(buckets) == 2  # the 100 have refilled: forgotten, as a full bucket means what a missing one does
    assert not buckets.take("busy", 1003.0)  # still limited


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_a_bucket_that_could_never_give_a_token_is_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="positive rate"):
        TokenBuckets(rate, burst)
