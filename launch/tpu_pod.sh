#!/usr/bin/env bash
# Runs `python -m librarian_jax.main --config=...` on every host of a Cloud TPU pod slice at once, through
# `gcloud compute tpus tpu-vm ssh --worker=all`. See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh --tpu=NAME --zone=ZONE [options] [-- extra flags for librarian_jax.main]

Runs the same training/eval command on every worker of a Cloud TPU VM pod slice:
  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE [--project=P] --worker=all --command='cd WORKDIR && \
    LIBRARIAN_JAX_DISTRIBUTED=1 [ENV...] exec PYTHON -m librarian_jax.main --config=CONFIG [extra flags]'
JAX finds the pod's hosts itself (jax.distributed.initialize() with no arguments on a TPU VM).

Options (defaults from the environment variables in brackets):
  --tpu=NAME          TPU VM name                                [TPU_NAME]
  --zone=ZONE         its zone                                   [TPU_ZONE, then ZONE]
  --project=PROJECT   GCP project (else gcloud's default)        [TPU_PROJECT]
  --config=SPEC       ml_collections config for main             [default: configs/grpo.py]
  --workdir=DIR       checkout of this repository on every host  [default: ~/librarian_jax]
  --python=PYTHON     interpreter on the hosts                   [default: python3]
  --env=KEY=VALUE     extra environment for main (repeatable)
  --copy-repo         first copy this checkout to WORKDIR on every worker (gcloud ... scp --recurse)
  --gcloud-arg=ARG    extra argument for gcloud ssh/scp, e.g. --gcloud-arg=--internal-ip (repeatable)
  --dry-run           print the commands instead of running them
  -h, --help          this help
Anything after `--` (or any unrecognised --flag) is passed to librarian_jax.main unchanged.
EOF
}

tpu="${TPU_NAME:-}"
zone="${TPU_ZONE:-${ZONE:-}}"
project="${TPU_PROJECT:-}"
config="configs/grpo.py"
workdir="~/librarian_jax"
python="python3"
copy_repo=0
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
    --env=*)
      kv="${1#*=}"
      if [[ ! "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
        echo "tpu_pod.sh: --env needs KEY=VALUE, got '$kv'" >&2
        exit 2
      fi
      envs+=("$kv")
      ;;
    --gcloud-arg=*) gcloud_args+=("${1#*=}") ;;
    --copy-repo) copy_repo=1 ;;
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
if ((${#missing[@]})); then
  echo "tpu_pod.sh: missing ${missing[*]}; see --help" >&2
  exit 2
fi

# The command each worker runs, quoted word by word for the remote bash.
# The workdir keeps a leading ~ unquoted so the remote shell expands it.
if [[ "$workdir" == "~/"* ]]; then
  remote_cd="cd ~/$(printf '%q' "${workdir#\~/}")"
else
  remote_cd="cd $(printf '%q' "$workdir")"
fi
remote_env="LIBRARIAN_JAX_DISTRIBUTED=1"
for kv in "${envs[@]}"; do
  remote_env+=" ${kv%%=*}=$(printf '%q' "${kv#*=}")"
done
remote_main="exec $(printf '%q' "$python") -m librarian_jax.main $(printf '%q' "--config=$config")"
for arg in "${extra[@]}"; do
  remote_main+=" $(printf '%q' "$arg")"
done
remote="$remote_cd && $remote_env $remote_main"

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

if ((copy_repo)); then
  repo_root="$(cd "$(dirname "$0")/.." && pwd)"
  run gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all "${gcloud_args[@]}" \
    --command="mkdir -p ${remote_cd#cd }"
  run gcloud compute tpus tpu-vm scp --recurse "$repo_root/." "$tpu:$workdir" "${where[@]}" --worker=all \
    "${gcloud_args[@]}"
fi
run gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all "${gcloud_args[@]}" --command="$remote"
