"""The leases a shared-store lookup pins blocks under (planner/tiers.py): a lease a step fetches
under stays held while the ranks may still be fetching -- that step and the next, since under
async scheduling the ranks run step N while the driver plans N+1 -- and is released only when
the plan after that ends; a lease whose answer no step used is released when its plan ends."""

from __future__ import annotations

from ray_attn.planner.tiers import SHARED, KVTiers


class FakeStores:
    """A store that holds every run it is asked for, one lease per lookup."""

    def __init__(self):
        self.leases, self.released = 0, []

    def lookup(self, hashes):
        self.leases += 1
        return len(hashes), "store-a", f"lease-{self.leases}"

    def release(self, store, lease):
        self.released.append(lease)


def _plan_step(tiers: KVTiers, hashes=None, fetch=True):
    """One plan call: a new request's leading hashes looked up and, if ``fetch``, taken."""
    tiers.begin_plan()
    if hashes is not None:
        hits = tiers.leading(hashes)
        assert hits == [(SHARED, "store-a")] * len(hashes)
        if fetch:
            tiers.claim(hits, list(range(len(hashes))), hashes)
    return tiers.take_transfers()


def test_a_fetched_lease_is_held_until_the_ranks_can_no_longer_read_it():
    stores = FakeStores()
    tiers = KVTiers(shared=stores, layout="x", block_size=16)
    t = _plan_step(tiers, [11, 12, 13])
    assert t.fetch_hashes == [11, 12, 13] and t.fetch_stores == ["store-a"] * 3
    assert stores.released == []  # the step that fetches has not even run yet
    _plan_step(tiers)
    assert stores.released == []  # async: the ranks may still run the fetching step
    _plan_step(tiers)
    assert stores.released == ["lease-1"]
    _plan_step(tiers)
    assert stores.released == ["lease-1"]  # once


def test_a_lease_no_step_fetched_under_is_released_with_its_plan():
    stores = FakeStores()
    tiers = KVTiers(shared=stores, layout="x", block_size=16)
    assert _plan_step(tiers, [21, 22], fetch=False) is None
    assert stores.released == ["lease-1"]
