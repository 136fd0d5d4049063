"""Progress bars whose time estimate holds from the first one they show.

tqdm's defaults estimate the time left from a rate smoothed over the last few redraws, redraw at
most every 0.1 s, and show an estimate from the first update on. Rows that finish in batches (the
in-process synthesis answers synth.batch_size prompts per generate call) defeat all three: the first
row arrives after a whole batch, the rest of the batch a moment later and inside the 0.1 s, so the
bar showed "1 row in 30 s" and 1:47:48 left, for the whole next batch, on a stage that took 3
minutes. `bar()` instead
  - redraws on every update (miniters 1, mininterval 0), so rows finished together show together;
  - estimates from the average rate since the bar started (rows done here / seconds: smoothing 0);
  - shows no estimate ("?") until min_done rows are done (MIN_DONE, or all of them when fewer).
"""
from __future__ import annotations

import sys

from tqdm import tqdm

MIN_DONE = 8  # rows done before the first estimate: one row's time says little about the rest
NO_ESTIMATE = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<?, ?{unit}/s{postfix}]"


class SettlingBar(tqdm):
    """tqdm with the settings above; `min_done`: rows done (past `initial`) before an estimate shows."""

    def __init__(self, *args, min_done: int = MIN_DONE, **kwargs):
        kwargs.update(smoothing=0, miniters=1, mininterval=0)
        todo = (kwargs.get("total") or 0) - (kwargs.get("initial") or 0)
        self.min_done = min(min_done, todo) if todo > 0 else min_done  # set first: the constructor draws the bar
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        if d["n"] - d["initial"] < self.min_done and d.get("bar_format") is None:
            d["bar_format"] = NO_ESTIMATE
        return d


def bar(total: int, desc: str, unit: str, initial: int = 0, min_done: int = MIN_DONE) -> SettlingBar:
    """A progress bar on stderr (`total` items, `initial` of them done before it starts)."""
    return SettlingBar(total=total, initial=initial, desc=desc, unit=unit, min_done=min_done, dynamic_ncols=True,
                       file=sys.stderr)
