#!/usr/bin/env bash
# One machine: a single moc_jax.main process, or N processes talking through a local coordinator,
# which exercises the multi-host code paths (per-process data shards, cross-process collectives)
# without a cluster.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local.sh [--processes N] [--devices_per_process M] [--port PORT] [--dry-run] -- MAIN_ARGS...

  --processes N            processes to start (default 1). N=1 runs moc_jax.main directly; N>1 adds
                           --coordinator_address=localhost:PORT --num_processes=N --process_id=i and
                           logs process i to WORKDIR/process_i.log (/tmp/process_i.log without --workdir)
  --devices_per_process M  fake CPU devices per process (default 1), via
                           XLA_FLAGS=--xla_force_host_platform_device_count=M
  --port PORT              coordinator port (default 12355, or MOC_PORT)
  --dry-run                print the commands instead of running them
  -h, --help               this text

N>1 or M>1 runs JAX on the CPU (JAX_PLATFORMS=cpu unless JAX_PLATFORMS is set). The interpreter is
$PYTHON, else .venv/bin/python if present, else python3. Example (2 processes x 4 devices):
  launch/local.sh --processes 2 --devices_per_process 4 -- --config=configs/moc.py:tiny \
      --workdir=runs/tiny2x4 --config.mesh.data=2 --config.mesh.fsdp=4
EOF
}

die() { echo "local.sh: $*" >&2; exit 2; }

quote() {  # words a shell reads back unchanged; single quotes only where needed
  local out=() w
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$w"); else out+=("'${w//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

PROCESSES=1 DEVICES=1 PORT=${MOC_PORT:-12355} DRY_RUN=0 MAIN_ARGS=()
while (($#)); do
  case $1 in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --opt=value -> --opt value
  case $1 in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --processes|--devices_per_process|--port)
      (($# >= 2)) || die "option $1 needs a value"
      [[ $2 =~ ^[1-9][0-9]*$ ]] || die "option $1 needs a positive integer, got '$2'"
      case $1 in --processes) PROCESSES=$2 ;; --devices_per_process) DEVICES=$2 ;; --port) PORT=$2 ;; esac
      shift 2 ;;
    --) shift; MAIN_ARGS=("$@"); break ;;
    *) die "unknown argument '$1' (arguments for moc_jax.main go after --; see --help)" ;;
  esac
done
((${#MAIN_ARGS[@]})) ||
  die "missing arguments for moc_jax.main after -- (e.g. -- --config=configs/moc.py:tiny --workdir=runs/tiny)"

if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

ENV=()
((DEVICES == 1)) || ENV+=("XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES")
# Fake CPU devices, and several processes sharing this machine's accelerators, both mean CPU.
((DEVICES == 1 && PROCESSES == 1)) || ENV+=("JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}")
CMD=("$PY" -m moc_jax.main "${MAIN_ARGS[@]}")

if ((PROCESSES == 1)); then
  if ((DRY_RUN)); then quote "${ENV[@]}" "${CMD[@]}"; exit 0; fi
  exec env "${ENV[@]}" "${CMD[@]}"
fi

LOG_DIR=/tmp
for ((i = 0; i < ${#MAIN_ARGS[@]}; i++)); do
  case ${MAIN_ARGS[i]} in
    --workdir=*) LOG_DIR=${MAIN_ARGS[i]#--workdir=} ;;
    --workdir) LOG_DIR=${MAIN_ARGS[i + 1]:-/tmp} ;;
  esac
done
CMD+=(--coordinator_address="localhost:$PORT" --num_processes="$PROCESSES")

if ((DRY_RUN)); then
  quote mkdir -p "$LOG_DIR"
  for ((i = 0; i < PROCESSES; i++)); do
    echo "$(quote "${ENV[@]}" "${CMD[@]}" --process_id=$i) > $(quote "$LOG_DIR/process_$i.log") 2>&1 &"
  done
  echo wait
  exit 0
fi

# wait -n -p reports which process ended, so a crash stops the others instead of leaving them
# blocked in a collective.
((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)) || die "--processes N>1 needs bash >= 5.1"
mkdir -p "$LOG_DIR"
declare -A PROC=()  # pid -> process id
# Background jobs of a script ignore Ctrl-C, so pass it on.
trap 'kill "${!PROC[@]}" 2>/dev/null; exit 130' INT TERM
for ((i = 0; i < PROCESSES; i++)); do
  env "${ENV[@]}" "${CMD[@]}" --process_id=$i >"$LOG_DIR/process_$i.log" 2>&1 &
  PROC[$!]=$i
  echo "process $i: pid $!, log $LOG_DIR/process_$i.log" >&2
done
status=0
while ((${#PROC[@]})); do
  unset pid
  if wait -n -p pid; then rc=0; else rc=$?; fi
  [[ -n ${pid:-} ]] || break  # nothing left to wait for
  i=${PROC[$pid]}; unset "PROC[$pid]"
  if ((rc != 0)); then
    status=1
    echo "local.sh: process $i failed (exit $rc); stopping the others. End of $LOG_DIR/process_$i.log:" >&2
    tail -n 20 "$LOG_DIR/process_$i.log" >&2
    ((${#PROC[@]} == 0)) || kill "${!PROC[@]}" 2>/dev/null || true
    wait
    break
  fi
done
exit $status
