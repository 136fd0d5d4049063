"""benchmarks/state_cache.py, its dry run on a CPU: the two tiers decided against the budgets given,
every kind of row bit-identical to a batch without a cache, a timing for each source of rows, and
first-epoch steps timed each way of putting rows into the host tier."""
import re

from benchmarks.state_cache import main


def test_the_dry_run_splits_the_rows_over_two_tiers_and_reads_them_back_exactly(capsys):
    main(["--device", "cpu", "--sequences", "240", "--device-free-gib", "0.3", "--host-gib", "0.4", "--repeats", "1",
          "--batch-tokens", "4096", "--fill", "--steps", "2", "--step-ms", "1"])
    out = capsys.readouterr().out
    kept = re.search(r"train: (\d+) on cpu, (\d+) in host memory, (\d+) never kept", out)
    assert kept and all(int(n) > 0 for n in kept.groups()) and sum(map(int, kept.groups())) == 240, out
    assert "GiB in host memory (50% of its 0.4 GiB available)" in out
    assert out.count("bit-identical True") == 2 and "bit-identical False" not in out
    for source in ("device tier", "host tier", "no cache (stand-in target)"):
        assert re.search(rf"batch from the {re.escape(source)}: \d+ rows, [\d,]+ tokens .*: [\d.]+ ms", out), source
    assert "host tier filled:" in out and "first-epoch batch into the host tier" in out
    assert "first-epoch steps, 2 each, a stand-in draft step of 1 ms" in out
    ratios = dict(re.findall(r"  (no cache|copy in put_rows|background copy \(HostPuts\)): [\d.]+ ms \(([\d.]+)x no cache\)", out))
    assert set(ratios) == {"no cache", "copy in put_rows", "background copy (HostPuts)"} and ratios["no cache"] == "1.00", out
