"""One JSON document against another, floats compared to 1e-9 relative."""
import pytest


def same(a, b, path="results") -> None:
    """Equal JSON, floats to 1e-9 relative: least-squares fits differ in their last digits between
    numpy builds, and a report remade on another machine is still the same report."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
