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


@pytest.fixture(scope="session")
def dvc_run(tmp_path_factory):
    """One `dvc repro` of the reduced project (tests/support/project.py), shared by the DVC tests:
    (root, stdout of that run). Tests work in their own copy (copy_run), never in `root`."""
    from tests.support.project import reproduced_project

    return reproduced_project(tmp_path_factory.mktemp("dvc-run"))
