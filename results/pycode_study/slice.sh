#!/bin/bash
# One slice of device time for the pycode study (PLAN.md), run from the repository root:
#   bash results/pycode_study/slice.sh start tune      # corpus, completed runs put back, stage started detached
#   bash results/pycode_study/slice.sh start speed     # timing runs of each configuration alone (depths 4, 8)
#   bash results/pycode_study/slice.sh wait 540        # wait up to 540 s for the stage, printing progress
#   bash results/pycode_study/slice.sh collect "$OUT"  # the run directories, without checkpoints, as one tarball
# `start` returns at once: the stage's runs go on in their own process session, so one stage can outlast a
# call and later calls of the same held machine `wait` on it. A stage's sweeps skip the runs already
# completed in results/pycode_study/runs/<group>/ (copied into place first) and resume killed ones, so a
# stage started again only trains what is left.
# Environment: STUDY (the study folder, default results/pycode_study), CORPUS (/tmp/pycode8k), RUNS
# (/tmp/runs), PREPARE (the prepare arguments), EXTRA (overrides added to every run), CONFIGS (the stage's
# configurations, one per line; default: the stage's). tests/test_study_slice.py runs it on the CPU so.
set -euo pipefail
HERE=${STUDY:-results/pycode_study}
CORPUS=${CORPUS:-/tmp/pycode8k}
RUNS=${RUNS:-/tmp/runs}
PREPARE=${PREPARE:---source python-code --vocab-size 8192 --workers 16}
EXTRA=${EXTRA:-}
STATE=$RUNS/.slice
mkdir -p "$RUNS/pycode_study" "$STATE"

corpus() {  # build the shards once per machine; every slice must read the corpus slice 1 read
  [ -f "$CORPUS/meta.json" ] || python3 -m k3lab.data.prepare $PREPARE --out "$CORPUS"
  python3 - "$CORPUS/meta.json" "$HERE/corpus.json" <<'PY'
import json, sys
from pathlib import Path
meta = json.loads(Path(sys.argv[1]).read_text())
src = meta["source"]
identity = {"sha256": src["sha256"], "documents": src["documents"], "bytes": src["bytes"],
            "vocab_size": meta["vocab_size"], "tokenizer_sha256": meta["tokenizer"]["sha256"],
            "train_tokens": meta["splits"]["train"]["tokens"], "val_tokens": meta["splits"]["val"]["tokens"]}
known = Path(sys.argv[2])
if known.exists() and json.loads(known.read_text()) != identity:
    sys.exit(f"corpus differs from {known}: {identity} against {known.read_text()}")
known.write_text(json.dumps(identity, indent=2) + "\n")
print("corpus:", identity)
PY
}

stage_configs() {  # one configuration per line: the overrides that make it (empty: the K3 default)
  case "$1" in
    tune|speed) printf '%s\n' "" decay=softplus glu=swiglu balance=sign optim=muon residual=standard optim=adamw ;;
    *) echo "unknown stage $1 (valid: tune, speed)" >&2; exit 2 ;;
  esac
}

stage_args() {  # the sweep of each configuration
  case "$1" in
    tune) echo "optim.lr_scale=0.5,1,2 seed=1000" ;;
    # timing runs, each alone on the GPU, for the headline's throughput ratio (analysis.report --speed)
    speed) echo "group=pycode_speed model.n_layers=4,8 train.tokens_per_param=null train.max_steps=150 train.val_every=150 seed=0" ;;
  esac
}

stage_concurrent() {  # 1: the stage's multiruns share the GPU at once; 0: one after another, each alone
  case "$1" in speed) echo 0 ;; *) echo 1 ;; esac
}

case "${1:-}" in
  start)
    stage=${2:?stage}
    corpus
    # runs/<group>/<run>, as collected; what this machine already holds is kept
    if [ -d "$HERE/runs" ]; then tar -C "$HERE/runs" -cf - . | tar -C "$RUNS" -xf - --skip-old-files; fi
    configs=${CONFIGS:-$(stage_configs "$stage")}
    args=$(stage_args "$stage")
    rm -f "$STATE/finished"
    # one multirun per configuration, all at once on the one GPU; the stage ends when all have
    # several processes compile at once: a few compile workers each instead of one per core each
    # concurrent runs' tokens/s are not their own: summary.json says device_shared, and the analysis takes no
    # throughput ratio from them
    concurrent=$(stage_concurrent "$stage")
    { echo "export TORCHINDUCTOR_COMPILE_THREADS=\${TORCHINDUCTOR_COMPILE_THREADS:-2} K3LAB_DEVICE_SHARED=$concurrent"
      i=0
      while IFS= read -r config; do
        i=$((i + 1))
        echo "python3 run.py -m experiment=pycode_study data.path=$CORPUS out_dir=$RUNS $config $args $EXTRA > $STATE/log.$i 2>&1 $([ "$concurrent" = 1 ] && echo '&')"
      done <<< "$configs"
      echo "wait; touch $STATE/finished"; } > "$STATE/stage.sh"
    grep -o '^python3[^>]*' "$STATE/stage.sh"
    setsid bash "$STATE/stage.sh" > /dev/null 2>&1 < /dev/null &
    echo "started stage $stage: $(grep -c '^python3' "$STATE/stage.sh") multiruns, logs in $STATE/"
    ;;
  wait)
    limit=${2:?seconds}
    t0=$SECONDS
    while [ ! -f "$STATE/finished" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do
      sleep 10
      done_runs=$(grep -l '"status": "completed"' "$RUNS"/*/*/summary.json 2>/dev/null | wc -l)
      echo "$((SECONDS - t0)) s: $done_runs runs completed"
    done
    [ -f "$STATE/finished" ] && echo "stage finished" || echo "stage still running"
    ;;
  collect)
    out=${2:?folder}
    tar --exclude=checkpoints --exclude=.sweep --exclude=.slice -czf "$out/runs.tgz" -C "$RUNS" .
    cp "$HERE/corpus.json" "$out/corpus.json"
    ls -la "$out"
    ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
