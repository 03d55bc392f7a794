"""Replica-local copies of the Serve app's metrics, rendered as Prometheus text for ``GET /metrics``
on the API port.

``ray.util.metrics`` values go to the Ray node's metrics agent, which Prometheus scrapes on the
agent's own port, aggregated per node; nothing in this process can read them back.  vLLM serves
``/metrics`` on its API port, and a scraper pointed at that port (or a quick ``curl``) expects to
find them there.  So every metric here is both: the Ray metric, fed as before, and a value this
replica keeps and renders.  The rendering is a snapshot of *this replica* since it started: with
several replicas each scrape answers for whichever replica served it (the ``replica`` label says
which); the Ray agent's export stays the cluster-wide view.
"""

from __future__ import annotations

import bisect
import math
import threading


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(pairs) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs) + "}" if pairs else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = "untyped"

    def __init__(self, ray_metric, name: str, description: str, tag_keys: tuple, lock: threading.Lock):
        self.ray, self.name, self.description, self.tag_keys = ray_metric, name, description, tag_keys
        self._defaults: dict = {}
        self._lock = lock
        self._values: dict[tuple, object] = {}

    def set_default_tags(self, tags: dict) -> None:
        self.ray.set_default_tags(tags)
        self._defaults = dict(tags)

    def _key(self, tags) -> tuple:
        t = {**self._defaults, **(tags or {})}
        return tuple((k, t.get(k, "")) for k in self.tag_keys)


class Counter(_Metric):
    kind = "counter"

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.ray.inc(value, tags=tags)
        key = self._key(tags)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def lines(self) -> list[str]:
        return [f"{self.name}_total{_labels(k)} {_num(v)}" for k, v in self._values.items()]


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, tags: dict | None = None) -> None:
        self.ray.set(value, tags=tags)
        with self._lock:
            self._values[self._key(tags)] = float(value)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(k)} {_num(v)}" for k, v in self._values.items()]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, ray_metric, name, description, tag_keys, lock, boundaries):
        super().__init__(ray_metric, name, description, tag_keys, lock)
        self.boundaries = list(boundaries)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self.ray.observe(value, tags=tags)
        key = self._key(tags)
        with self._lock:
            counts, total = self._values.get(key, ([0] * (len(self.boundaries) + 1), 0.0))
            counts[bisect.bisect_left(self.boundaries, value)] += 1  # le: a value on a bound is in it
            self._values[key] = (counts, total + value)

    def lines(self) -> list[str]:
        out = []
        for k, (counts, total) in self._values.items():
            run = 0
            for b, c in zip(self.boundaries + [math.inf], counts):
                run += c
                out.append(f"{self.name}_bucket{_labels(k + (('le', _num(b)),))} {run}")
            out += [f"{self.name}_sum{_labels(k)} {_num(total)}", f"{self.name}_count{_labels(k)} {run}"]
        return out


class Registry:
    """Makes the metrics (each a Ray metric too) and renders them all."""

    def __init__(self):
        from ray.util import metrics

        self._ray = metrics
        self._lock = threading.Lock()
        self.metrics: list[_Metric] = []

    def _add(self, m: _Metric) -> _Metric:
        self.metrics.append(m)
        return m

    def counter(self, name, description, tag_keys) -> Counter:
        return self._add(Counter(self._ray.Counter(name, description=description, tag_keys=tag_keys),
                                 name, description, tag_keys, self._lock))

    def gauge(self, name, description, tag_keys) -> Gauge:
        return self._add(Gauge(self._ray.Gauge(name, description=description, tag_keys=tag_keys),
                               name, description, tag_keys, self._lock))

    def histogram(self, name, description, boundaries, tag_keys) -> Histogram:
        ray_metric = self._ray.Histogram(name, description=description, boundaries=boundaries,
                                         tag_keys=tag_keys)
        return self._add(Histogram(ray_metric, name, description, tag_keys, self._lock, boundaries))

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        out = []
        with self._lock:
            for m in self.metrics:
                out += [f"# HELP {m.name} {m.description}", f"# TYPE {m.name} {m.kind}", *m.lines()]
        return "\n".join(out) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
