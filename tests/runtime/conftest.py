import pytest
import ray

from ray_attn.runtime.cluster import init_local_ray


@pytest.fixture(scope="session")
def ray_local():
    """One embedded Ray instance for the runtime tests (starting one costs ~5 s)."""
    if not ray.is_initialized():
        init_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


RECOVERY_TIMES: list[tuple[str, float]] = []


@pytest.fixture
def record_recovery(request):
    """Tests report how long a recovery took; the times are printed at the end of the run."""
    def record(seconds: float) -> None:
        RECOVERY_TIMES.append((request.node.name, seconds))
    return record


def pytest_terminal_summary(terminalreporter):
    if RECOVERY_TIMES:
        terminalreporter.section("dead-rank recovery times (goal on CPU: < 15 s)")
        for name, s in RECOVERY_TIMES:
            terminalreporter.write_line(f"{name}: {s:.1f} s")
