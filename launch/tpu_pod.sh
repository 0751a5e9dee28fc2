#!/usr/bin/env bash
# Runs `python -m librarian_jax.main --config=...` on every host of a Cloud TPU pod slice at once, through
# `gcloud compute tpus tpu-vm ssh --worker=all`, with JAX's multi-process variables set. See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh --tpu=NAME --zone=ZONE [options] [-- extra flags for librarian_jax.main]

Runs the same training/eval command on every worker of a Cloud TPU VM pod slice:
  1. gcloud compute tpus tpu-vm describe NAME --format=json   (worker IPs: the slice's size and worker 0)
  2. gcloud compute tpus tpu-vm ssh NAME --worker=all --command='cd WORKDIR &&
       JAX_PROCESS_ID=<this worker's agent-worker-number, from the metadata server> &&
       JAX_COORDINATOR_ADDRESS=<worker 0 IP>:PORT JAX_NUM_PROCESSES=<workers> [ENV...]
       exec PYTHON -m librarian_jax.main --config=CONFIG [extra flags]'

Options (defaults from the environment variables in brackets):
  --tpu=NAME          TPU VM name                                [TPU_NAME]
  --zone=ZONE         its zone                                   [TPU_ZONE, then ZONE]
  --project=PROJECT   GCP project (else gcloud's default)        [TPU_PROJECT]
  --config=SPEC       ml_collections config for main             [default: configs/grpo.py]
  --workdir=DIR       checkout of this repository on every host  [default: ~/librarian_jax]
  --python=PYTHON     interpreter on the hosts                   [default: python3]
  --port=PORT         JAX coordinator port on worker 0           [default: 8476]
  --workers=IP,IP,..  the workers' internal IPs, worker 0 first (skips the describe call)
  --env=KEY=VALUE     extra environment for main (repeatable)
  --copy-repo         first copy this checkout to WORKDIR on every worker (gcloud ... scp --recurse)
  --install           then install it on every worker: PYTHON -m pip install -e '.[tpu]' (the TPU
                      runtime that matches the project's jax)
  --gcloud-arg=ARG    extra argument for gcloud ssh/scp, e.g. --gcloud-arg=--internal-ip (repeatable)
  --dry-run           print the commands instead of running them
  -h, --help          this help
Anything after `--` (or any unrecognised --flag) is passed to librarian_jax.main unchanged.
EOF
}

die() {
  echo "tpu_pod.sh: $*" >&2
  exit 2
}

tpu="${TPU_NAME:-}"
zone="${TPU_ZONE:-${ZONE:-}}"
project="${TPU_PROJECT:-}"
config="configs/grpo.py"
workdir="~/librarian_jax"
python="python3"
port=8476
workers=""
copy_repo=0
install=0
dry_run=0
envs=()
gcloud_args=()
extra=()

while (($#)); do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --config=*) config="${1#*=}" ;;
    --workdir=*) workdir="${1#*=}" ;;
    --python=*) python="${1#*=}" ;;
    --port=*) port="${1#*=}" ;;
    --workers=*) workers="${1#*=}" ;;
    --env=*)
      [[ "${1#*=}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs KEY=VALUE, got '${1#*=}'"
      envs+=("${1#*=}")
      ;;
    --gcloud-arg=*) gcloud_args+=("${1#*=}") ;;
    --copy-repo) copy_repo=1 ;;
    --install) install=1 ;;
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

missing=()
[[ -n "$tpu" ]] || missing+=("--tpu (or TPU_NAME)")
[[ -n "$zone" ]] || missing+=("--zone (or TPU_ZONE)")
((${#missing[@]} == 0)) || die "missing ${missing[*]}; see --help"
[[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"

where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")

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

run() {
  if ((dry_run)); then
    show "$@"
  else
    "$@"
  fi
}

# 1. The workers: worker 0 hosts JAX's coordinator; their number is the process count.
if [[ -z "$workers" ]]; then
  describe=(gcloud compute tpus tpu-vm describe "$tpu" "${where[@]}" --format=json)
  if ((dry_run)); then
    show "${describe[@]}"
    workers="<worker-0-ip>,<...>"
  else
    workers="$("${describe[@]}" | python3 -c '
import json, sys
print(",".join(e["ipAddress"] for e in json.load(sys.stdin).get("networkEndpoints", [])))
')" || die "could not read the workers of TPU '$tpu' (gcloud compute tpus tpu-vm describe failed)"
  fi
fi
IFS=, read -r -a worker_list <<<"$workers"
((${#worker_list[@]} >= 1)) && [[ -n "${worker_list[0]}" ]] || die "TPU '$tpu' lists no workers"
num_workers="${#worker_list[@]}"
((dry_run)) && [[ "$workers" == "<worker-0-ip>,<...>" ]] && num_workers="<number-of-workers>"

# 2. The command each worker runs, quoted word by word for the remote bash. The workdir keeps a leading ~
# unquoted so the remote shell expands it; the process id is the worker's number from the metadata server.
if [[ "$workdir" == "~/"* ]]; then
  remote_dir="~/$(printf '%q' "${workdir#\~/}")"
else
  remote_dir="$(printf '%q' "$workdir")"
fi
metadata="http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"
remote="cd $remote_dir || exit 1; JAX_PROCESS_ID=\"\$(curl -sf -H 'Metadata-Flavor: Google' $metadata)\""
remote+=" && [ -n \"\$JAX_PROCESS_ID\" ]"
remote+=" || { echo 'tpu_pod.sh: cannot read agent-worker-number from the metadata server' >&2; exit 1; }"
remote+="; export JAX_PROCESS_ID JAX_COORDINATOR_ADDRESS=$(printf '%q' "${worker_list[0]}:$port")"
remote+=" JAX_NUM_PROCESSES=$(printf '%q' "$num_workers")"
for kv in "${envs[@]}"; do
  remote+=" ${kv%%=*}=$(printf '%q' "${kv#*=}")"
done
remote+="; exec $(printf '%q' "$python") -m librarian_jax.main $(printf '%q' "--config=$config")"
for arg in "${extra[@]}"; do
  remote+=" $(printf '%q' "$arg")"
done

if ((copy_repo)); then
  repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  run gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all "${gcloud_args[@]}" \
    --command="mkdir -p $remote_dir"
  run gcloud compute tpus tpu-vm scp --recurse "$repo_root/." "$tpu:$workdir" "${where[@]}" --worker=all \
    "${gcloud_args[@]}"
fi
if ((install)); then
  run gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all "${gcloud_args[@]}" \
    --command="cd $remote_dir && $(printf '%q' "$python") -m pip install -e '.[tpu]'"
fi
run gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all "${gcloud_args[@]}" --command="$remote"
