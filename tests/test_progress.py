"""The synthesis bar's time estimate holds from the first one it shows (draftlab/progress.py), on the
new user's case: 240 rows answered 32 at a time, 30 s a batch (4 minutes in all)."""
import io
import re

import pytest
from tqdm import std

from draftlab import progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def estimates(make_bar, clock: Clock, total=240, batch=32, seconds=30.0) -> list[tuple[float, float | None]]:
    """(true seconds left, the bar's estimate or None for "?") at every redraw, rows finishing a
    batch at a time."""
    out = io.StringIO()
    bar = make_bar(total, out)
    seen, done, start = [], 0, clock.now
    while done < total:
        clock.now += seconds  # the batch computes
        for _ in range(min(batch, total - done)):
            bar.update(1)
            done += 1
            clock.now += 1e-4  # its rows are handed back one after the other, a moment apart
        text = out.getvalue().split("\r")[-1]
        left = start + seconds * -(-total // batch) - clock.now
        m = re.search(r"<([0-9:]+),", text)
        seen.append((left, None if m is None else seconds_of(m.group(1))))
    bar.close()
    return seen


def seconds_of(text: str) -> float:
    parts = [int(x) for x in text.split(":")]
    return sum(v * 60 ** i for i, v in enumerate(reversed(parts)))


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(std, "time", c)  # tqdm reads its clock through this name
    return c


def test_the_estimate_is_never_far_off_and_never_hours_for_minutes(clock):
    seen = estimates(lambda total, out: progress.SettlingBar(total=total, desc="synthesize train", unit="row", file=out), clock)
    shown = [(left, eta) for left, eta in seen if eta is not None]
    assert shown and len(shown) == len(seen)  # from the first batch on: 32 rows >= MIN_DONE
    for left, eta in shown[:-1]:
        assert abs(eta - left) <= max(0.5 * left, 5), (left, eta)  # within half the true time left


def test_no_estimate_until_a_few_rows_are_done(clock):
    out = io.StringIO()
    bar = progress.SettlingBar(total=240, desc="synthesize train", unit="row", file=out)
    clock.now += 30
    bar.update(1)
    assert "<?" in out.getvalue().split("\r")[-1]  # one row after 30 s says nothing about the other 239
    for _ in range(progress.MIN_DONE - 1):
        bar.update(1)
    assert re.search(r"<[0-9:]+,", out.getvalue().split("\r")[-1])
    bar.close()


def test_a_resumed_split_counts_only_this_runs_rows(clock):
    out = io.StringIO()
    bar = progress.SettlingBar(total=240, initial=200, desc="synthesize train", unit="row", file=out)
    clock.now += 30
    for _ in range(8):
        bar.update(1)
    eta = seconds_of(re.search(r"<([0-9:]+),", out.getvalue().split("\r")[-1]).group(1))
    assert 100 <= eta <= 125  # 32 left at 8 rows / 30 s: 120 s (not the 200 resumed rows' rate)
    bar.close()


def test_plain_tqdm_shows_the_estimate_the_new_user_saw(clock):
    """The case above with tqdm's defaults: hours for a 4-minute stage (the reason for the bar)."""
    seen = estimates(lambda total, out: std.tqdm(total=total, file=out), clock)
    assert seen[0][1] is not None and seen[0][1] > 3600 > 10 * seen[0][0]
