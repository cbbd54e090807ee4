#!/usr/bin/env bash
# Cloud TPU VM slice (e.g. v5p-64 = 8 hosts): create it, install the repo on every host, run
# moc_jax.main on every host at once (JAX needs one process per host), fetch the logs, delete it.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh create|setup|run|stop|logs|delete [options] [-- MAIN_ARGS...]

  create   gcloud compute tpus tpu-vm create (--accelerator, --version)
  setup    on every worker: clone --repo into --dir, check out --ref, `make venv` (which installs the
           libtpu requirements.lock pins for the jax it pins)
  run      on every worker, the same command: cd DIR && .venv/bin/python -m moc_jax.main --distributed
           MAIN_ARGS (jax.distributed finds the slice's other workers itself), each worker's output also
           appended to DIR/logs/<run>.<worker's hostname>.log; with --detach in the background, so the run
           outlives the ssh session (follow it with `logs`, end it with `stop`)
  stop     on every worker: SIGTERM to moc_jax.main, which saves a checkpoint at a step every worker
           agrees on (JAX's preemption sync) and exits; a TPU serves one process at a time
  logs     copy config.json, metrics.jsonl, loss.png, tensorboard/ of --workdir and worker 0's log
           from worker 0 into LOCAL_DIR/<workdir name>/ (checkpoints stay where --workdir is)
  delete   delete the slice

Options (the default comes from the environment variable in brackets):
  --name NAME         TPU name [TPU_NAME]; required
  --zone ZONE         e.g. us-east5-a [TPU_ZONE]; required
  --project PROJECT   [TPU_PROJECT]; default: gcloud's configured project
  --accelerator TYPE  [TPU_ACCELERATOR]; default v5p-64
  --version VERSION   TPU runtime [TPU_VERSION]; default v2-alpha-tpuv5 (the v5p runtime)
  --repo URL          git URL of this repository [MOC_REPO]; required by setup
  --ref REF           branch, tag or full commit hash [MOC_REF]; default main
  --dir DIR           checkout on the workers, relative to the home directory [MOC_DIR]; default moc_jax
  --workdir DIR       run directory, relative to --dir unless absolute [MOC_WORKDIR]; required by logs;
                      run adds --workdir=DIR when MAIN_ARGS have none
  --local_dir DIR     where logs copies to [MOC_LOCAL_DIR]; default tpu_logs
  --detach            run: start on every worker in the background and return
  --dry-run           print each command instead of running it
  -h, --help          this text

The workers need python3.12 for `make venv`. On a slice of more than one host the workdir must be one
directory every worker sees (gs://BUCKET/... or a shared file system): each worker writes its own shards
of every checkpoint there, and a worker's local disk would hold a checkpoint no one can restore. Mesh
sizes are config overrides, e.g.
  launch/tpu_pod.sh run --name moc --zone us-east5-a --detach -- --config=configs/moc.py:262k \
      --workdir=gs://BUCKET/runs/262k --config.mesh.data=4 --config.mesh.memory=8
EOF
}

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

# Prints words so that a shell reads them back unchanged; single quotes only where needed.
quote() {
  local out=() w
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$w"); else out+=("'${w//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

run() { if ((DRY_RUN)); then quote "$@"; else "$@"; fi; }

# The name a run's worker logs take: the last part of its --workdir (`run` otherwise).
run_name() {
  local name=run prev= w
  for w in "$@"; do
    case $w in --workdir=*) name=${w#--workdir=} ;; *) [[ $prev == --workdir ]] && name=$w ;; esac
    prev=$w
  done
  name=${name%/}; echo "${name##*/}"
}

NAME=${TPU_NAME:-} ZONE=${TPU_ZONE:-} PROJECT=${TPU_PROJECT:-}
ACCELERATOR=${TPU_ACCELERATOR:-v5p-64} VERSION=${TPU_VERSION:-v2-alpha-tpuv5}
REPO=${MOC_REPO:-} REF=${MOC_REF:-main} DIR=${MOC_DIR:-moc_jax}
WORKDIR=${MOC_WORKDIR:-} LOCAL_DIR=${MOC_LOCAL_DIR:-tpu_logs}
DRY_RUN=0 DETACH=0 CMD= MAIN_ARGS=()

while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --opt=value -> --opt value
  case $1 in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --detach) DETACH=1; shift ;;
    --name|--zone|--project|--accelerator|--version|--repo|--ref|--dir|--workdir|--local_dir)
      (($# >= 2)) || die "option $1 needs a value"
      case $1 in
        --name) NAME=$2 ;; --zone) ZONE=$2 ;; --project) PROJECT=$2 ;;
        --accelerator) ACCELERATOR=$2 ;; --version) VERSION=$2 ;; --repo) REPO=$2 ;;
        --ref) REF=$2 ;; --dir) DIR=$2 ;; --workdir) WORKDIR=$2 ;; --local_dir) LOCAL_DIR=$2 ;;
      esac
      shift 2 ;;
    --) shift; MAIN_ARGS=("$@"); break ;;
    create|setup|run|stop|logs|delete)
      [[ -z $CMD ]] || die "one command at a time (got $CMD and $1)"
      CMD=$1; shift ;;
    *) die "unknown argument '$1' (arguments for moc_jax.main go after --; see --help)" ;;
  esac
done

[[ -n $CMD ]] || die "missing command: create, setup, run, stop, logs or delete (see --help)"
[[ -n $NAME ]] || die "missing --name (or TPU_NAME)"
[[ -n $ZONE ]] || die "missing --zone (or TPU_ZONE)"
[[ $CMD == run || ${#MAIN_ARGS[@]} -eq 0 ]] || die "only run takes arguments after --"
[[ $CMD == run || $DETACH == 0 ]] || die "only run takes --detach"

GCLOUD_OPTS=(--zone="$ZONE")
[[ -z $PROJECT ]] || GCLOUD_OPTS+=(--project="$PROJECT")
TPU=(gcloud compute tpus tpu-vm)

case $CMD in
  create)
    run "${TPU[@]}" create "$NAME" "${GCLOUD_OPTS[@]}" --accelerator-type="$ACCELERATOR" \
      --version="$VERSION" ;;
  setup)
    [[ -n $REPO ]] || die "missing --repo (or MOC_REPO): the git URL the workers clone"
    d=$(printf %q "$DIR")
    # Fetching the ref and checking out FETCH_HEAD pins every worker to the same commit, whether
    # REF is a branch, a tag or a hash. requirements.lock pins libtpu beside jax (Linux x86-64, as the
    # TPU VMs are): without it JAX would run on the hosts' CPUs, and `run` would say so in its log.
    remote="set -e; [ -d $d/.git ] || git clone $(printf %q "$REPO") $d; cd $d"
    remote+="; git fetch origin $(printf %q "$REF"); git checkout --detach FETCH_HEAD; make venv"
    run "${TPU[@]}" ssh "$NAME" "${GCLOUD_OPTS[@]}" --worker=all --command "$remote" ;;
  run)
    ((${#MAIN_ARGS[@]})) ||
      die "missing arguments for moc_jax.main after -- (e.g. -- --config=configs/moc.py:262k --workdir=runs/262k)"
    args=("${MAIN_ARGS[@]}")
    if [[ -n $WORKDIR ]] && ! printf '%s\n' "${args[@]}" | grep -qE '^--workdir(=|$)'; then
      args+=(--workdir="$WORKDIR")
    fi
    main=".venv/bin/python -m moc_jax.main --distributed$(printf ' %q' "${args[@]}")"
    log="logs/$(printf %q "$(run_name "${args[@]}")").\$(hostname).log"
    if ((DETACH)); then  # a session of its own: the run survives the ssh connection that started it
      main="nohup setsid $main >> $log 2>&1 < /dev/null & echo \"\$(hostname): started\""
    else  # appended: a resumed run keeps the log of its earlier parts
      main="set -o pipefail && $main 2>&1 | tee -a $log"
    fi
    remote="cd $(printf %q "$DIR") && mkdir -p logs && $main"
    run "${TPU[@]}" ssh "$NAME" "${GCLOUD_OPTS[@]}" --worker=all --command "$remote" ;;
  stop)
    run "${TPU[@]}" ssh "$NAME" "${GCLOUD_OPTS[@]}" --worker=all \
      --command "pkill -TERM -f 'python -m moc_jax.main' && echo \"\$(hostname): stopping\" || true" ;;
  logs)
    [[ -n $WORKDIR ]] || die "missing --workdir (or MOC_WORKDIR): the run directory to copy"
    [[ $WORKDIR == /* ]] && src=$WORKDIR || src=$DIR/$WORKDIR
    # Only the small files: checkpoints are large, and on a multi-host slice worker 0 holds only its shards.
    run mkdir -p "$LOCAL_DIR/$(basename "$WORKDIR")"
    run "${TPU[@]}" scp --worker=0 --recurse "$NAME:$src/config.json" "$NAME:$src/metrics.jsonl" \
      "$NAME:$src/loss.png" "$NAME:$src/tensorboard" "$NAME:$DIR/logs/$(run_name --workdir="$WORKDIR").*.log" \
      "$LOCAL_DIR/$(basename "$WORKDIR")/" "${GCLOUD_OPTS[@]}" ;;
  delete)
    run "${TPU[@]}" delete "$NAME" "${GCLOUD_OPTS[@]}" --quiet ;;
esac
