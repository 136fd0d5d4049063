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
def dvc_run(tmp_path_factory, worker_id):
    """One `dvc repro` of the reduced project (tests/support/project.py), shared by the DVC tests:
    (root, stdout of that run). Tests work in their own copy (copy_run), never in `root`. Under
    pytest-xdist the first worker to ask makes it in the run's shared temp folder and the others wait
    for it (a file lock), so the run is made once whatever the number of workers."""
    from filelock import FileLock

    from tests.support.project import reproduced_project

    if worker_id == "master":  # not distributed (-n0)
        return reproduced_project(tmp_path_factory.mktemp("dvc-run"))
    shared = tmp_path_factory.getbasetemp().parent  # this test run's temp folder, above each worker's own
    root, stdout = shared / "dvc-run", shared / "dvc-run.stdout"
    with FileLock(str(shared / "dvc-run.lock")):
        if not stdout.exists():
            if root.exists():
                raise AssertionError(f"{root}: the shared dvc repro failed on the worker that made it (its error is above)")
            root.mkdir()
            stdout.write_text(reproduced_project(root)[1])
    return root, stdout.read_text()
