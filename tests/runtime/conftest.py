import pytest


@pytest.fixture(scope="session")
def ray_local(shared_ray):
    """The run's one embedded Ray (tests/shared_ray.py; starting one costs 5-20 s)."""
    yield


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
