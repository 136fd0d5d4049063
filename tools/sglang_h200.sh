#!/usr/bin/env bash
# The real-SGLang session on the H200, in machine calls made back to back (a machine that idles
# 30 s is given back and everything on it is lost; device time is 30 minutes per session).
#
# Here, once:   bash tools/sglang_h200.sh prepare          # wheel parts sized to what a call carries
# Then the calls, each with its part carried (the printed plan names them):
#   call 1..N-1: bash tools/sglang_h200.sh receive K           carry: [.sglang-wheels/pK]
#   call N:      bash tools/sglang_h200.sh receive N run       carry: [.sglang-wheels/pN]
#   call N+1..:  bash tools/sglang_h200.sh run                 (resumes; stops before work that would not fit)
# Results come back as $OUT/sglang-h200.tar.gz (no data, no weights): unpack it into
# reports/sglang-h200/ here. tools/sglang_h200.py says what each phase does.
set -euo pipefail
cmd=${1:?usage: sglang_h200.sh prepare | receive K [run] | run}
shift

tree_mb() {  # what every call carries besides a wheel part: tracked + untracked-not-ignored files
  git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print int($1 / 1048576) + 1}'
}

case "$cmd" in
  prepare)
    part=$((60 - $(tree_mb)))
    echo "working tree ~$(tree_mb) MB: wheel parts of at most $part MB"
    bash ../shared/gpu/prepare_sglang_wheels.sh .sglang-wheels "$part" 2>&1 | grep -v '^WARNING: Location'
    ;;
  receive)
    k=${1:?receive K}
    shift
    mkdir -p /root/pool && cp ".sglang-wheels/p$k"/* /root/pool/
    echo "part $k received: $(ls /root/pool | wc -l) wheels in /root/pool"
    if [ "${1:-}" = run ]; then shift; exec bash "$0" run "$@"; fi  # (a bare `[ ] &&` would exit 1 without `run`)
    ;;
  run)
    t0=$(date +%s)
    if [ ! -d /tmp/site/sglang ]; then
      [ -d /root/pool ] || { echo "no /root/pool: this is a fresh machine; carry the wheel parts again"; exit 2; }
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/pool/*.whl
    fi
    export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    left=$((560 - ($(date +%s) - t0)))  # a call may run 600 s; keep 40 s for the pack and the transfer
    python3 tools/sglang_h200.py --results .scratch/h200 --budget-s "$left" --pack "${OUT:-.scratch}/sglang-h200.tar.gz" "$@"
    ;;
  *)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
