#!/usr/bin/env bash
# The GPU report in ONE command on a lent GPU machine without network (docs/performance.md, "GPU report").
#
# Here, once: `make gpu-wheels` (the wheels into .whl/, SST-2 and E2E into .gpu-data/, both git-ignored).
# There, from the repository root, carrying .whl and .gpu-data:
#     bash benchmarks/gpu_session.sh                 # BUDGET_S=480 by default; extra arguments go to gpu-report
# It installs the carried wheels into a --target folder (the image's torch, accelerate, numpy... stay), puts it
# on PYTHONPATH, checks the imports, runs `make gpu-report` within what is left of BUDGET_S (counted from the
# start of this script), and copies the tables, the JSON and the logs into $OUT (what a call brings back).
set -u
started=$(date +%s)
BUDGET_S=${BUDGET_S:-480}
cd "$(dirname "$0")/.." || exit 1
SITE=${GPU_SITE:-/tmp/gpu-site}
PY=${GPU_PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
    # transformers in a folder of its own: if the carried one does not import against the image's packages,
    # the image's own transformers is used instead (and the tables record which ran)
    rm -rf "$SITE" "$SITE-transformers"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE-transformers" \
        .whl/transformers-*.whl || exit 1
    others=$(ls .whl/*.whl | grep -v '/transformers-')
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $others || exit 1
    # opacus's wheel also installs top-level `benchmarks` and `examples` folders: never in place of this checkout's
    rm -rf "$SITE/benchmarks" "$SITE/examples"
    export PYTHONPATH="$SITE-transformers:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_session: no .whl/ (run \`make gpu-wheels\` here and carry .whl): the image's packages only" >&2
fi
[ -d .gpu-data ] && export HF_DPFILTER_DATA="$PWD/.gpu-data"

check='import torch, transformers, peft, accelerate, opacus, datasets, trl, hf_dpfilter
print("gpu_session:", "python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "peft", peft.__version__,
      "accelerate", accelerate.__version__, "opacus", opacus.__version__, "datasets", datasets.__version__)'
if ! $PY -c "$check"; then
    if [ -d "$SITE-transformers" ]; then
        echo "gpu_session: the carried transformers does not import here; trying the image's own" >&2
        export PYTHONPATH="$SITE${PYTHONPATH#"$SITE-transformers:$SITE"}"
        $PY -c "$check"
    fi || echo "gpu_session: imports fail (above): the report's steps will fail" >&2
fi

left=$((BUDGET_S - ($(date +%s) - started)))
[ "$left" -lt 60 ] && left=60  # the install overran: still a short report (0 would mean no budget at all)
if command -v make >/dev/null; then
    make -s gpu-report GPU_PYTHON="$PY" BUDGET_S="$left" GPU_REPORT_ARGS="$*"
else
    $PY -m benchmarks gpu-report --budget-s "$left" "$@"
fi
rc=$?

if [ -n "${OUT:-}" ] && [ -d benchmarks/results/gpu_report ]; then
    # at most 8 files come back: the tables, the page they went into, and everything else as one archive
    cp benchmarks/results/gpu_report/gpu_report.md benchmarks/results/gpu_report/gpu_report.json "$OUT"/ 2>/dev/null
    cp docs/performance.md "$OUT"/ 2>/dev/null
    tar -czf "$OUT/gpu_report_results.tar.gz" benchmarks/results/gpu_report 2>/dev/null
fi
exit $rc
