"""A multi-turn chat workload driven through engines in a closed loop (scripts/bench_kv_tiers.py).

Users hold conversations over long documents: turn t's prompt is the user's document, every
earlier question and answer, and a new question.  Each engine is driven by a thread of its own;
``route(user, turn)`` picks the engine of a turn, at most ``concurrency`` requests are in flight
per engine, and a user's next turn joins the back of the queue when its answer ends.  Per
request: the time from submission to the first token (TTFT), and the answer.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ray_attn.engine import SamplingParams


def counters(eng) -> dict:
    st = eng.planner.stats()
    return {k: v for k, v in st.items() if isinstance(v, (int, float))} | {
        "kv_copy_s": eng.stats.kv_copy_s, "preemptions": eng.stats.preemptions}


class Workload:
    def __init__(self, a, vocab: int):
        rng = np.random.default_rng(a.seed)
        self.users, self.turns, self.answer_tokens = a.users, a.turns, a.answer_tokens
        self.docs = [rng.integers(0, vocab, a.doc_tokens).tolist() for _ in range(a.users)]
        self.questions = [[rng.integers(0, vocab, a.question_tokens).tolist() for _ in range(a.turns)]
                          for _ in range(a.users)]
        last = a.doc_tokens + a.turns * (a.question_tokens + a.answer_tokens)
        self.request_blocks = -(-last // a.block_size)  # a user's last turn, answer included

    @property
    def working_blocks(self) -> int:
        return self.users * self.request_blocks

    def subset(self, users: int) -> "Workload":
        """The first ``users`` conversations, the same as in this workload."""
        w = Workload.__new__(Workload)
        w.__dict__.update(self.__dict__, users=users, docs=self.docs[:users], questions=self.questions[:users])
        return w


def percentile(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


class ClosedLoop:
    """Engines each driven by a thread; ``route(user, turn)`` picks the engine of a turn; at most
    ``concurrency`` requests in flight per engine; a user's next turn is queued (at the back) when
    its answer ends."""

    def __init__(self, engines, wl: Workload, concurrency: int, route, desc: str, quiet: bool,
                 tie_gaps: bool = False):
        self.engines, self.wl, self.concurrency, self.route = engines, wl, concurrency, route
        # tie_gaps: the top two logprobs of every answer token, to tell a fork at a near-tie (bf16
        # numerics of a different batch) from a wrong cache (same_tokens)
        self.params = SamplingParams(max_tokens=wl.answer_tokens, ignore_eos=True, logprobs=2 if tie_gaps else None)
        self.cond = threading.Condition()
        self.queues = [deque() for _ in engines]
        for u in range(wl.users):
            self.queues[route(u, 0)].append(u)
        self.turn = [0] * wl.users
        self.history = [list(d) for d in wl.docs]
        self.remaining = wl.users * wl.turns
        self.records: list[dict] = []
        self.error: BaseException | None = None
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.remaining, desc=desc, unit="req", disable=quiet, leave=False)

    def run(self) -> float:
        threads = [threading.Thread(target=self._guarded, args=(i,), daemon=True) for i in range(len(self.engines))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        self.bar.close()
        if self.error is not None:
            raise self.error
        return wall

    def _guarded(self, i: int) -> None:
        try:
            self._drive(i)
        except BaseException as e:  # noqa: BLE001 -- re-raised by run()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _drive(self, i: int) -> None:
        eng, live = self.engines[i], {}
        while True:
            todo = []
            with self.cond:
                while len(live) + len(todo) < self.concurrency and self.queues[i]:
                    u = self.queues[i].popleft()
                    todo.append((u, self.turn[u], self.history[u] + self.wl.questions[u][self.turn[u]]))
                if not live and not todo:
                    if self.remaining == 0 or self.error is not None:
                        return
                    self.cond.wait(0.05)
                    continue
            for u, t, prompt in todo:
                rec = dict(user=u, turn=t, replica=i, prompt=prompt, submit=time.perf_counter(), first=None)
                live[eng.add_request(prompt, self.params)] = rec
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                rec = live.get(o.request_id)
                if rec is None:
                    continue
                if rec["first"] is None:
                    rec["first"] = now
                if o.finished:
                    if o.finish_reason != "length":
                        raise RuntimeError(f"request {o.request_id} ended {o.finish_reason}: {o.error}")
                    del live[o.request_id]
                    eng.release(o.request_id)
                    rec.update(end=now, output=list(o.output_token_ids), cached=o.num_cached_tokens,
                               gaps=[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] if o.logprobs else None)
                    u = rec["user"]
                    with self.cond:
                        self.history[u] = rec["prompt"] + rec["output"]
                        self.turn[u] += 1
                        self.remaining -= 1
                        if self.turn[u] < self.wl.turns:
                            self.queues[self.route(u, self.turn[u])].append(u)
                        self.records.append(rec)
                        self.cond.notify_all()
                    self.bar.update(1)


def run_loop(a, name: str, engines, wl: Workload, route) -> tuple[dict, dict, list[float], dict | None]:
    """One run: its row, its answers by (user, turn), its TTFTs, and with ``a.tie_margin`` each
    answer's top-1 minus top-2 logprob per token."""
    loop = ClosedLoop(engines, wl, a.concurrency, route, name, a.quiet, tie_gaps=bool(a.tie_margin))
    cpu0 = time.process_time()
    wall = loop.run()
    cpu = time.process_time() - cpu0  # this process's CPU time: all of it with in-process ranks
    recs = loop.records
    ttft = [r["first"] - r["submit"] for r in recs]
    later = [r["first"] - r["submit"] for r in recs if r["turn"] > 0]
    d = {}
    for eng in engines:
        now = counters(eng)
        for k, v in now.items():
            d[k] = d.get(k, 0) + v - eng.baseline.get(k, 0)
    bs, bb = a.block_size, a.block_bytes * a.tp
    host, shared = d.get("host_hit_blocks", 0) * bs, d.get("shared_hit_blocks", 0) * bs
    out_tokens = sum(len(r["output"]) for r in recs)
    prompt_tokens = sum(len(r["prompt"]) for r in recs)
    row = dict(run=name, num_blocks=engines[0].planner.pool.num_blocks, requests=len(recs), wall_s=wall, cpu_s=cpu,
               out_tok_s=out_tokens / wall, req_s=len(recs) / wall,
               ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
               ttft_p50_later_turns_s=percentile(later, 50),
               prompt_tokens=prompt_tokens, hit_tokens=d["prefix_cache_hits"],
               hit_rate=d["prefix_cache_hits"] / max(1, d["prefix_cache_queries"]),
               hit_tokens_device=d["prefix_cache_hits"] - host - shared, hit_tokens_host=host,
               hit_tokens_shared=shared, offloaded_MB=d.get("offloaded_blocks", 0) * bb / 1e6,
               onloaded_MB=d.get("onloaded_blocks", 0) * bb / 1e6, published_MB=d.get("published_blocks", 0) * bb / 1e6,
               fetched_MB=d.get("fetched_blocks", 0) * bb / 1e6, copy_s=d["kv_copy_s"],
               blocks_per_offload=d.get("offloaded_blocks", 0) / max(1, d.get("offload_steps", 0)),
               blocks_per_onload=d.get("onloaded_blocks", 0) / max(1, d.get("onload_steps", 0)),
               evictions=d.get("num_evictions", 0), preemptions=d["preemptions"])
    answers = {(r["user"], r["turn"]): r["output"] for r in recs}
    gaps = {(r["user"], r["turn"]): r["gaps"] for r in recs} if a.tie_margin else None
    return row, answers, sorted(ttft), gaps


def same_tokens(x: dict, y: dict, what: str, gaps=(), margin: float = 0.0) -> dict:
    """Greedy tokens of the requests both runs made (every one, unless one run is a subset).

    On a GPU, bf16 results depend on the batch a token is computed in (a prefix copied back from
    the host is attention over stored keys; recomputed, it is a different GEMM shape), so two
    correct runs may pick different tokens where the top two are within rounding of each other;
    from there the user's conversation differs (its history feeds every later turn).  With
    ``gaps`` (each run's top-1 minus top-2 logprob per answer token, from ``run_loop``) each
    user's first differing token is a *fork*; ``forks_at_near_ties`` holds when, at every fork,
    both runs' gaps were below ``margin`` nats -- a wrong cache shows up as a fork where a run was
    sure of its token.  Turns after a fork are not compared."""
    keys = sorted(set(x) & set(y))
    differ = [k for k in keys if x[k] != y[k]]
    fork_gaps = []
    if gaps:
        for u in sorted({u for u, _ in differ}):
            t = min(t for v, t in differ if v == u)
            p = next((i for i, (s, r) in enumerate(zip(x[(u, t)], y[(u, t)])) if s != r), None)
            if p is None:  # one answer a prefix of the other: not a fork at a token
                fork_gaps.append(float("inf"))
                continue
            fork_gaps.append(max(g[(u, t)][p] for g in gaps))
            keys = [k for k in keys if not (k[0] == u and k[1] > t)]
    n = sum(len(x[k]) for k in keys)
    print(f"{what}: greedy tokens {'DIFFER in %d requests' % len(differ) if differ else 'identical'} "
          f"({len(keys)} requests, {n} tokens compared){'; first (user, turn) %s' % (differ[0],) if differ else ''}"
          + (f"; {len(fork_gaps)} users forked, largest top-2 gap at a fork {max(fork_gaps):.4f} nats "
             f"(near-tie margin {margin})" if fork_gaps else ""))
    return dict(tokens_identical=not differ, compared_requests=len(keys), compared_tokens=n,
                differing_requests=len([k for k in differ if k in keys]), forks=len(fork_gaps),
                fork_gaps=[round(g, 5) for g in fork_gaps],
                forks_at_near_ties=all(g < margin for g in fork_gaps) if gaps else not differ)


