"""``init_local_ray``: a node that times out at start is started again, anything else is raised at
once, and a start that keeps timing out ends in the error after a bounded number of tries.
(``ray.init`` is replaced here: the real failure needs a machine too loaded to start a raylet.)"""

from __future__ import annotations

import pytest

from ray_attn.runtime import cluster

TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed"


class FakeRay:
    def __init__(self, failures):
        self.failures, self.calls, self.shutdowns = list(failures), [], 0

    def init(self, **kwargs):
        self.calls.append(kwargs)
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


def test_a_start_that_timed_out_is_tried_again(monkeypatch):
    fake = FakeRay([Exception(TIMEOUT)])
    monkeypatch.setattr(cluster, "ray", fake)
    cluster.init_local_ray(num_cpus=2)
    assert fake.calls == [{"address": "local", "num_cpus": 2}] * 2
    assert fake.shutdowns == 1  # what the failed start left is shut down before the next


def test_another_error_is_raised_at_once(monkeypatch):
    fake = FakeRay([ValueError("num_cpus must be >= 0")])
    monkeypatch.setattr(cluster, "ray", fake)
    with pytest.raises(ValueError, match="num_cpus"):
        cluster.init_local_ray(num_cpus=-1)
    assert len(fake.calls) == 1 and fake.shutdowns == 0


def test_tries_are_bounded(monkeypatch):
    fake = FakeRay([Exception(TIMEOUT)] * 10)
    monkeypatch.setattr(cluster, "ray", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.init_local_ray()
    assert len(fake.calls) == cluster.LOCAL_START_ATTEMPTS
