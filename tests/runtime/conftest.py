import pytest
import ray


@pytest.fixture(scope="session")
def ray_local():
    """One embedded Ray instance for the runtime tests (starting one costs ~5 s)."""
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
