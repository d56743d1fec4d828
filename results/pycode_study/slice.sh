#!/bin/bash
# One slice of device time for the pycode study (PLAN.md), run from the repository root:
#   bash results/pycode_study/slice.sh start tune      # corpus, completed runs put back, stage started detached
#   bash results/pycode_study/slice.sh start next      # what the tuning says comes next (analysis.ablate --next)
#   bash results/pycode_study/slice.sh start ladder 5  # the ladder's configurations at depth 5 (or "6,7")
#   bash results/pycode_study/slice.sh plan ladder 6,7 # the multiruns a stage would start, started nothing
#   bash results/pycode_study/slice.sh start speed     # timing runs of each configuration alone (depths 4, 7; or "4")
#   bash results/pycode_study/slice.sh wait 540        # wait up to 540 s for the started stages, printing progress
#   bash results/pycode_study/slice.sh collect "$OUT"  # the run directories, without checkpoints, as one tarball
#   bash results/pycode_study/slice.sh import runs.tgz # here: its completed runs into runs/<group>/ (5 files each)
# `start` returns at once: the stage's runs go on in their own process session, so one stage can outlast a
# call and later calls of the same held machine `wait` on it. A stage's sweeps skip the runs already
# completed in results/pycode_study/runs/<group>/ (copied into place first) and resume killed ones, so a
# stage started again only trains what is left; a multirun with a failed run is retried once, at once.
# Stage `next`: per configuration, one more tuning point beyond the grid's edge where the best rate sits
# there, else the reported seeds at the chosen rate; start it again once those finish. Stage `ladder`: the
# K3 default, residual=standard and optim=adamw at their chosen rates, seed 0, one multirun per
# configuration and depth, all at once; a configuration whose rate is still at its grid's edge is left out,
# said so.
# Environment: STUDY (the study folder, default results/pycode_study), CORPUS (/tmp/pycode8k), RUNS
# (/tmp/runs), PREPARE (the prepare arguments), EXTRA (overrides added to every run), CONFIGS (the tune and
# speed stages' configurations, one per line; default: the stage's). tests/test_study_slice.py runs it on
# the CPU so.
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
  python3 - "$CORPUS/meta.json" "$HERE/corpus.json" "$STATE/corpus.json" <<'PY'
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
for path in (known, *map(Path, sys.argv[3:])):  # the study's record, and the copy `collect` sends back
    path.write_text(json.dumps(identity, indent=2) + "\n")
print("corpus:", identity)
PY
}

stage_configs() {  # one configuration per line: the overrides that make it (empty: the K3 default)
  printf '%s\n' "" decay=softplus glu=swiglu balance=sign optim=muon residual=standard optim=adamw
}

stage_args() {  # the sweep of each configuration in stages tune and speed
  case "$1" in
    tune) echo "optim.lr_scale=0.5,1,2 seed=1000" ;;
    # timing runs, each alone on the GPU, for the headline's throughput ratio (analysis.report --speed)
    speed) echo "group=pycode_speed model.n_layers=${2:-4,7} train.tokens_per_param=null train.max_steps=150 train.val_every=150 seed=0" ;;
  esac
}

stage_commands() {  # one run.py -m argument list per line: one multirun each
  case "$1" in
    tune|speed)
      args=$(stage_args "$1" "${2:-}")
      while IFS= read -r config; do
        echo "experiment=pycode_study data.path=$CORPUS out_dir=$RUNS $config $args"
      done <<< "${CONFIGS:-$(stage_configs)}" ;;
    next)
      python3 -m analysis.ablate "$RUNS/pycode_study" --tune --tuned optim.lr_scale --next | sed 's/^python run.py -m //' ;;
    ladder)
      python3 - "$RUNS/pycode_study" "${2:?depths, e.g. 5 or 6,8}" <<'PY'
import sys
from analysis.ablate import ablation_table
from analysis.tuning import tuning_table
from analysis.collect import collect

LADDER = (("residual", "block_attnres"), ("residual", "standard"), ("optim", "adamw"))  # the K3 default first
tuning = tuning_table(ablation_table(collect([sys.argv[1]], curves=False).runs, tune=True, tuned=["optim.lr_scale"]))
ready = 0
for switch, option in LADDER:
    row = tuning[(tuning["switch"] == switch) & (tuning["option"] == option) & tuning["chosen"].astype(bool)]
    if row.empty or row["widen"].iloc[0]:
        print(f"ladder: {switch}={option} has no rate inside its grid yet (run stage next until it has); "
              "left out", file=sys.stderr)
        continue
    overrides = row["command"].iloc[0].removeprefix("python run.py -m ").rsplit(" seed=", 1)[0]
    for depth in sys.argv[2].split(","):  # one multirun per depth: all of them side by side
        print(f"{overrides} model.n_layers={depth} seed=0")
    ready += 1
sys.exit(0 if ready else "ladder: no configuration is ready")
PY
      ;;
    *) echo "unknown stage $1 (valid: tune, next, ladder DEPTHS, speed)" >&2; exit 2 ;;
  esac
}

stage_concurrent() {  # 1: the stage's multiruns share the GPU at once; 0: one after another, each alone
  case "$1" in speed) echo 0 ;; *) echo 1 ;; esac
}

completed() {  # how many runs under $RUNS have finished
  find "$RUNS" -mindepth 3 -maxdepth 3 -name summary.json -exec grep -l '"status": "completed"' {} + 2>/dev/null | wc -l
}

put_back() {  # runs/<group>/<run>, as collected, into $RUNS; what this machine already holds is kept
  if [ -d "$HERE/runs" ]; then tar -C "$HERE/runs" -cf - . | tar -C "$RUNS" -xf - --skip-old-files; fi
}

case "${1:-}" in
  plan)
    put_back
    stage_commands "${2:?stage}" "${3:-}" | sed 's/^/python3 run.py -m /'
    ;;
  start)
    stage=${2:?stage}
    corpus
    put_back
    commands=$(stage_commands "$stage" "${3:-}")
    [ -n "$commands" ] || { echo "stage $stage: nothing to run"; exit 0; }
    name=$stage${3:-}  # e.g. ladder5: stages of different names may run at the same time
    [ -f "$STATE/running.$name" ] && { echo "stage $name is running already" >&2; exit 2; }
    # several processes compile at once: a few compile workers each instead of one per core each;
    # concurrent runs' tokens/s are not their own: summary.json says device_shared, and the analysis takes no
    # throughput ratio from them
    concurrent=$(stage_concurrent "$stage")
    script=$STATE/stage.$name.sh
    # a multirun that reports a failed run is started once more: it skips the completed runs and resumes the
    # failed one from its last checkpoint, in a new process (a CUDA fault leaves its process's context unusable)
    { echo "export TORCHINDUCTOR_COMPILE_THREADS=\${TORCHINDUCTOR_COMPILE_THREADS:-2} K3LAB_DEVICE_SHARED=$concurrent"
      echo 'again() { "$@" || { echo "a run failed: the multirun once more"; "$@"; }; }'
      i=0
      while IFS= read -r args; do
        i=$((i + 1))
        echo "again python3 run.py -m $args $EXTRA > $STATE/log.$name.$i 2>&1 $([ "$concurrent" = 1 ] && echo '&')"
      done <<< "$commands"
      echo "wait; rm -f $STATE/running.$name"; } > "$script"
    sed -n 's/^again \(python3[^>]*\).*/\1/p' "$script"
    touch "$STATE/running.$name"
    setsid bash "$script" > /dev/null 2>&1 < /dev/null &
    echo "started stage $name: $(grep -c '^again python3' "$script") multiruns, logs in $STATE/"
    ;;
  wait)
    limit=${2:?seconds}
    t0=$SECONDS
    running() { compgen -G "$STATE/running.*" > /dev/null; }
    while running && [ $((SECONDS - t0)) -lt "$limit" ]; do
      sleep 10
      echo "$((SECONDS - t0)) s: $(completed) runs completed"
    done
    if running; then echo "still running: $(cd "$STATE" && ls running.* | sed 's/^running.//' | tr '\n' ' ')"
    else echo "stage finished"; fi
    ;;
  collect)
    out=${2:?folder}
    tar --exclude=checkpoints --exclude=.sweep --exclude=.slice -czf "$out/runs.tgz" -C "$RUNS" .
    cp "$STATE/corpus.json" "$out/corpus.json"
    ls -la "$out"
    ;;
  import)  # here, after a slice: the completed runs of a collected runs.tgz into the study's runs/<group>/
    python3 - "${2:?runs.tgz}" "$HERE" <<'PY'
import json, shutil, sys, tarfile, tempfile
from pathlib import Path

KEEP = ("config.yaml", "metrics.csv", "metrics.jsonl", "overrides.yaml", "summary.json")  # no plots, no checkpoints
tgz, here = Path(sys.argv[1]), Path(sys.argv[2])
corpus, known = tgz.with_name("corpus.json"), here / "corpus.json"
if corpus.exists() and known.exists() and json.loads(corpus.read_text()) != json.loads(known.read_text()):
    sys.exit(f"{corpus} differs from {known}: these runs read another corpus; nothing imported")
added, there, left = 0, 0, []
with tempfile.TemporaryDirectory() as tmp:
    with tarfile.open(tgz) as tar:
        tar.extractall(tmp, filter="data")
    for summary in sorted(Path(tmp).glob("*/*/summary.json")):
        run, s = summary.parent, json.loads(summary.read_text())
        name = f"{run.parent.name}/{run.name}"
        if s.get("status") != "completed":
            left.append(f"{name}: {s.get('status')}; {next(iter((s.get('error') or '').splitlines()), '')}")
            continue
        dest = here / "runs" / name
        if (dest / "summary.json").exists():
            there += 1
            continue
        dest.mkdir(parents=True, exist_ok=True)
        for f in KEEP:
            shutil.copy2(run / f, dest / f)
        added += 1
print(f"imported {added} completed runs into {here / 'runs'}; {there} were there already; {len(left)} not completed")
for line in left:
    print(f"  not completed (not imported): {line}")
PY
    ;;
  *) sed -n 2,23p "$0"; exit 2 ;;
esac
