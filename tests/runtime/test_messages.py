"""The wire format of steps: ``messages.dumps`` / ``loads`` and the worker's bytes-in, bytes-out."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine
from ray_attn.planner import ScheduledRequest
from ray_attn.runtime import InProcessExecutor, StepInput, StepOutput, messages
from ray_attn.runtime.messages import SamplingInputs

IDS = itertools.count()


def tiny_config() -> EngineConfig:
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, seed=3)
    return EngineConfig(model=model, cache=CacheConfig(num_blocks=64),
                        parallel=ParallelConfig(device="cpu"), max_num_batched_tokens=256)


def assert_same(a, b, path="msg"):
    """Equal field by field; arrays with the same dtype, shape and values."""
    assert type(a) is type(b), path
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
        assert b.flags.writeable, f"{path}: torch.from_numpy wants a writable array"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def engine():
    cfg = tiny_config()
    return LLMEngine(cfg, InProcessExecutor(cfg))


@pytest.fixture
def worker(engine):
    return engine.executor.worker


def a_step(engine, n=5, **kw) -> StepInput:
    rng = np.random.default_rng(0)
    reqs = [ScheduledRequest(next(IDS), rng.integers(0, 128, 20 + 7 * i).tolist()) for i in range(n)]
    plan = engine.planner.plan(reqs)
    for r in reqs:  # the plan stays valid; the next test plans afresh
        engine.planner.free(r.req_id)
    return StepInput(plan, np.full(n, 0.7, np.float32), np.arange(n, dtype=np.int64),
                     np.zeros(n, np.int32), **kw)


def test_step_round_trips_with_writable_arrays(engine):
    step = a_step(engine, step_id=4)
    assert_same(step, messages.loads(messages.dumps(step)))


@pytest.mark.parametrize("a", [np.zeros(0, np.int32), np.array(5), np.arange(12).reshape(3, 4)[:, 1],
                               np.arange(6, dtype=">i4").reshape(2, 3).T, np.zeros((0, 5), np.float32),
                               np.array(["a", None], object)])
def test_odd_arrays_round_trip(a):
    b = messages.loads(messages.dumps({"x": a}))["x"]
    assert b.dtype == a.dtype and b.shape == a.shape and (b == a).all()


def test_what_plain_pickle_cannot_still_travels():
    out = StepOutput(np.arange(3, dtype=np.int32), timings={"hook": lambda: 1})
    back = messages.loads(messages.dumps(out))
    assert back.timings["hook"]() == 1 and np.array_equal(back.token_ids, out.token_ids)


def test_worker_answers_bytes_with_bytes(engine, worker):
    step = a_step(engine, return_logits=True)
    direct = worker.execute_step(step)
    wired = worker.execute_step(messages.dumps(step))
    assert isinstance(wired, bytes)
    wired = messages.loads(wired)
    assert np.array_equal(direct.token_ids, wired.token_ids)
    assert np.array_equal(direct.logits, wired.logits)
    assert wired.timings["worker_s"] > 0


def test_sampling_inputs_and_logprobs_travel(engine, worker):
    """A step's sampling inputs go out, and its logprobs come back, through the wire format."""
    f32 = np.float32
    si = SamplingInputs(top_k=np.array([0, 3, 0, 0, 5], np.int32), top_p=np.full(5, 0.9, f32),
                        min_p=np.zeros(5, f32), penalty_rows=np.array([1], np.int32),
                        presence_penalty=np.array([0.5], f32), frequency_penalty=np.array([0.2], f32),
                        repetition_penalty=np.array([1.3], f32), history=np.array([3, 130, 4], np.int32),
                        history_lens=np.array([3], np.int32), min_tokens_rows=np.array([2], np.int32),
                        min_tokens_ids=np.array([7], np.int32), logprobs=np.array([-1, 2, 0, -1, 4], np.int32))
    step = a_step(engine, sampling=si)
    assert_same(step, messages.loads(messages.dumps(step)))
    direct = worker.execute_step(step)
    wired = messages.loads(worker.execute_step(messages.dumps(step)))
    assert direct.logprobs.rows.tolist() == [1, 2, 4] and direct.logprobs.logprobs.shape == (3, 5)
    assert_same(direct.logprobs, wired.logprobs)
    assert np.array_equal(direct.token_ids, wired.token_ids)
