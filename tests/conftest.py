"""Shared test setup."""
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Micro models run fastest on one thread, and a busy 2-core machine makes two threads spin
    against each other (10-20x slower, measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
