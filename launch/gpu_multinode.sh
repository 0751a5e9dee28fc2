#!/usr/bin/env bash
# Starts `python -m librarian_jax.main --config=...` as one JAX process per node (or per GPU) of a multi-node
# GPU job, setting JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID for each. See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/gpu_multinode.sh [mode] [options] [-- extra flags for librarian_jax.main]

Modes:
  (inside a SLURM allocation: sbatch/salloc; the default when SLURM_JOB_ID is set)
      srun --nodes=$SLURM_JOB_NUM_NODES --ntasks-per-node=K launch/gpu_multinode.sh --slurm-task ...
      every task exports JAX_COORDINATOR_ADDRESS=<first node>:PORT, JAX_NUM_PROCESSES=$SLURM_NTASKS,
      JAX_PROCESS_ID=$SLURM_PROCID (and JAX_LOCAL_DEVICE_IDS=$SLURM_LOCALID when K > 1), then runs main.
  --coordinator=HOST:PORT --num-processes=N --process-id=I
      plain environment: run this once on every node yourself (process I of N; HOST is process 0's node).
  --local=N
      N processes on this machine (coordinator localhost:PORT), process i on GPU i (JAX_LOCAL_DEVICE_IDS=i);
      waits for all, and stops the others as soon as one fails.

Options:
  --config=SPEC          ml_collections config for main       [default: configs/grpo.py]
  --port=PORT            coordinator port (SLURM/local modes) [default: 12355, or JAX_COORDINATOR_PORT]
  --procs-per-node=K     SLURM: processes per node, one GPU each (K = GPUs per node); default 1 process
                         per node owning all its GPUs
  --python=PYTHON        interpreter                          [default: python3, or PYTHON]
  --env=KEY=VALUE        extra environment for main (repeatable)
  --dry-run              print the commands (with their environment) instead of running them
  -h, --help             this help
Anything after `--` (or any unrecognised --flag) is passed to librarian_jax.main unchanged.
EOF
}

mode=""
config="configs/grpo.py"
port="${JAX_COORDINATOR_PORT:-12355}"
procs_per_node=1
python="${PYTHON:-python3}"
coordinator=""
num_processes=""
process_id=""
local_n=""
dry_run=0
envs=()
extra=()

die() {
  echo "gpu_multinode.sh: $*" >&2
  exit 2
}

while (($#)); do
  case "$1" in
    --config=*) config="${1#*=}" ;;
    --port=*) port="${1#*=}" ;;
    --procs-per-node=*) procs_per_node="${1#*=}" ;;
    --python=*) python="${1#*=}" ;;
    --coordinator=*) coordinator="${1#*=}" ;;
    --num-processes=*) num_processes="${1#*=}" ;;
    --process-id=*) process_id="${1#*=}" ;;
    --local=*)
      mode="local"
      local_n="${1#*=}"
      ;;
    --slurm-task) mode="slurm-task" ;;
    --env=*)
      [[ "${1#*=}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs KEY=VALUE, got '${1#*=}'"
      envs+=("${1#*=}")
      ;;
    --dry-run) dry_run=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    --)
      shift
      extra+=("$@")
      break
      ;;
    *) extra+=("$1") ;;
  esac
  shift
done

is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_int "$port" || die "--port must be a number, got '$port'"
is_int "$procs_per_node" && ((procs_per_node >= 1)) || die "--procs-per-node must be >= 1, got '$procs_per_node'"
if [[ -z "$mode" ]]; then
  if [[ -n "$coordinator$num_processes$process_id" ]]; then
    mode="manual"
  elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
    mode="slurm"
  else
    die "no SLURM allocation (SLURM_JOB_ID unset); give --coordinator/--num-processes/--process-id, or --local=N; see --help"
  fi
fi

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
main_cmd=("$python" -m librarian_jax.main "--config=$config" "${extra[@]}")

# Prints a command so it can be pasted into a shell: words with special characters in single quotes.
show() {
  local out="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+="$word "
    else
      out+="'${word//\'/\'\\\'\'}' "
    fi
  done
  echo "${out% }"
}

# Runs (or, with --dry-run, prints) main with JAX's distributed variables: run_main ADDRESS N ID [LOCAL_IDS].
run_main() {
  local -a env_words=("JAX_COORDINATOR_ADDRESS=$1" "JAX_NUM_PROCESSES=$2" "JAX_PROCESS_ID=$3")
  [[ -n "${4:-}" ]] && env_words+=("JAX_LOCAL_DEVICE_IDS=$4")
  env_words+=("${envs[@]}")
  if ((dry_run)); then
    show env "${env_words[@]}" "${main_cmd[@]}"
  else
    exec env "${env_words[@]}" "${main_cmd[@]}"
  fi
}

case "$mode" in
  manual)
    [[ -n "$coordinator" && -n "$num_processes" && -n "$process_id" ]] ||
      die "plain mode needs all of --coordinator=HOST:PORT --num-processes=N --process-id=I"
    [[ "$coordinator" =~ ^[^:]+:[0-9]+$ ]] || die "--coordinator must be HOST:PORT, got '$coordinator'"
    is_int "$num_processes" && ((num_processes >= 1)) || die "--num-processes must be >= 1, got '$num_processes'"
    is_int "$process_id" && ((process_id < num_processes)) ||
      die "--process-id must be in [0, $num_processes), got '$process_id'"
    run_main "$coordinator" "$num_processes" "$process_id"
    ;;

  local)
    is_int "$local_n" && ((local_n >= 1)) || die "--local must be >= 1, got '$local_n'"
    address="localhost:$port"
    if ((dry_run)); then
      for ((i = 0; i < local_n; i++)); do (run_main "$address" "$local_n" "$i" "$i"); done
      exit 0
    fi
    # Each process gets its own process group (set -m) so stopping it also stops anything it started.
    set -m
    pids=()
    stop_all() {
      local pid
      for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    }
    trap 'stop_all; exit 130' INT TERM
    for ((i = 0; i < local_n; i++)); do
      (run_main "$address" "$local_n" "$i" "$i") &
      pids+=("$!")
    done
    remaining=("${pids[@]}")
    status=0
    while ((${#remaining[@]})); do
      rc=0
      finished=""
      wait -n -p finished "${remaining[@]}" || rc=$?
      kept=()
      for pid in "${remaining[@]}"; do [[ "$pid" == "$finished" ]] || kept+=("$pid"); done
      remaining=("${kept[@]}")
      if ((rc != 0)); then
        echo "gpu_multinode.sh: local process $finished exited with status $rc; stopping the others" >&2
        stop_all
        wait 2>/dev/null || true
        status=$rc
        break
      fi
    done
    exit "$status"
    ;;

  slurm)
    [[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "SLURM_JOB_NODELIST is unset: run inside sbatch/salloc"
    nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
    is_int "$nodes" || die "SLURM_JOB_NUM_NODES is unset or not a number: '${nodes}'"
    if command -v scontrol >/dev/null 2>&1; then
      hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")" # (no `| head`: SIGPIPE under pipefail)
      head_node="${hosts%%$'\n'*}"
    else
      head_node="${SLURM_JOB_NODELIST%%,*}" # a plain list (no [a-b] ranges) without scontrol
      [[ "$head_node" != *"["* ]] || die "cannot expand '$SLURM_JOB_NODELIST' without scontrol"
    fi
    task=(srun "--nodes=$nodes" "--ntasks-per-node=$procs_per_node" "--ntasks=$((nodes * procs_per_node))"
      --kill-on-bad-exit=1 bash "$self" --slurm-task "--config=$config" "--python=$python" "--procs-per-node=$procs_per_node")
    for kv in "${envs[@]}"; do task+=("--env=$kv"); done
    task+=(-- "${extra[@]}")
    if ((dry_run)); then
      show env "GPU_MULTINODE_COORDINATOR=$head_node:$port" "${task[@]}"
    else
      GPU_MULTINODE_COORDINATOR="$head_node:$port" exec "${task[@]}"
    fi
    ;;

  slurm-task)
    : "${GPU_MULTINODE_COORDINATOR:?set by gpu_multinode.sh in SLURM mode}"
    : "${SLURM_NTASKS:?--slurm-task runs under srun}" "${SLURM_PROCID:?--slurm-task runs under srun}"
    local_ids=""
    ((procs_per_node > 1)) && local_ids="${SLURM_LOCALID:?SLURM_LOCALID unset}"
    run_main "$GPU_MULTINODE_COORDINATOR" "$SLURM_NTASKS" "$SLURM_PROCID" "$local_ids"
    ;;
esac
