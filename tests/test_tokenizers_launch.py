"""launch/: the TPU-pod and multi-node GPU launchers, run for real against stand-in gcloud/srun/python.

The stand-ins are tiny shell scripts on PATH that record the argv and environment they were given, so these
tests check the exact commands and JAX variables each process would get, without a cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "launch" / "tpu_pod.sh"
GPU = ROOT / "launch" / "gpu_multinode.sh"

# Records "argv (one per line)" and the JAX variables to $RECORD_DIR/<name>.<JAX_PROCESS_ID or pid>.
RECORDER = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    name="$(basename "$0")"
    out="$RECORD_DIR/$name.${JAX_PROCESS_ID:-$$}"
    printf '%s\\n' "$@" > "$out.argv"
    env | grep -E '^(JAX_|EXTRA_)' | sort > "$out.env"
    if [[ -n "${FAIL_ID:-}" && "${JAX_PROCESS_ID:-}" == "$FAIL_ID" ]]; then exit 3; fi
    if [[ -n "${SLEEP:-}" ]]; then sleep "$SLEEP"; touch "$out.finished"; fi
    """
)


@pytest.fixture()
def fake_bin(tmp_path) -> Path:
    """A bin dir with recording stand-ins for python, gcloud, curl, scontrol and srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fakepython").write_text(RECORDER)
    # gcloud: `describe` answers with two workers; anything else (ssh, scp) is recorded.
    describe = json.dumps({"networkEndpoints": [{"ipAddress": "10.0.0.7"}, {"ipAddress": "10.0.0.8"}]})
    answer = f"[[ \"$4\" == describe ]] && {{ echo '{describe}'; exit; }}\n"
    shebang = "#!/usr/bin/env bash\n"
    (bin_dir / "gcloud").write_text(RECORDER.replace(shebang, shebang + answer))
    # curl: the metadata server of worker $FAKE_WORKER.
    curl = '#!/usr/bin/env bash\n[[ "$*" == *agent-worker-number* ]] && echo "$FAKE_WORKER"\n'
    (bin_dir / "curl").write_text(curl)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu01\\ngpu02\\n'\n")
    # srun: run the task command once per task with SLURM's per-task variables, like srun on 1 node per task.
    (bin_dir / "srun").write_text(
        textwrap.dedent(
            """\
            #!/usr/bin/env bash
            printf '%s\\n' "$@" > "$RECORD_DIR/srun.argv"
            while [[ "$1" == --* ]]; do shift; done
            for id in 0 1; do SLURM_NTASKS=2 SLURM_PROCID=$id SLURM_LOCALID=0 "$@" || exit $?; done
            """
        )
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    record = tmp_path / "record"
    record.mkdir()
    return bin_dir


def _run(script: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_", "JAX_"))}
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env={**base, **(env or {})}, cwd=cwd
    )


def _env(fake_bin: Path, **extra: str) -> dict[str, str]:
    record = str(fake_bin.parent / "record")
    return {"PATH": f"{fake_bin}:{os.environ['PATH']}", "RECORD_DIR": record, **extra}


def _read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_scripts_parse_and_have_help():
    for script in (TPU, GPU):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        done = _run(script, "--help")
        assert done.returncode == 0 and "Usage:" in done.stdout and "--dry-run" in done.stdout


def test_tpu_pod_runs_main_on_every_worker(fake_bin, tmp_path):
    workdir = tmp_path / "my repo"
    workdir.mkdir()
    args = (
        "--tpu=pod-1",
        "--zone=us-east5-a",
        "--project=proj",
        f"--workdir={workdir}",
        f"--python={fake_bin / 'fakepython'}",
        "--config=configs/grpo.py:qwen3_5_4b",
        "--env=EXTRA_FLAGS=--a=1 --b",
        "--",
        "--config.train.num_steps=3",
        "--note=it's a test",
    )
    dry = _run(TPU, "--dry-run", *args, env=_env(fake_bin))
    assert dry.returncode == 0, dry.stderr
    describe, ssh = (shlex.split(line) for line in dry.stdout.splitlines())
    assert describe == [
        "gcloud", "compute", "tpus", "tpu-vm", "describe", "pod-1", "--zone=us-east5-a", "--project=proj",
        "--format=json",
    ]  # fmt: skip
    assert ssh[:8] == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-1", "--zone=us-east5-a", "--project=proj"
    ]  # fmt: skip
    assert "--worker=all" in ssh
    # Run for real: the stand-in gcloud gets the printed ssh argv, with the described workers filled in.
    real = _run(TPU, *args, env=_env(fake_bin))
    assert real.returncode == 0, real.stderr
    record = fake_bin.parent / "record"
    (argv_file,) = record.glob("gcloud.*.argv")
    gcloud_argv = argv_file.read_text().splitlines()
    filled = [a.replace("\\<worker-0-ip\\>", "10.0.0.7").replace("\\<number-of-workers\\>", "2") for a in ssh]
    assert ["gcloud", *gcloud_argv] == filled
    # What each worker's shell runs: cd into the checkout, then main with the flags forwarded verbatim and
    # the JAX variables of that worker.
    command = next(a for a in gcloud_argv if a.startswith("--command="))[len("--command=") :]
    for worker in ("0", "1"):
        ran = subprocess.run(
            ["bash", "-c", command], env=_env(fake_bin, FAKE_WORKER=worker), capture_output=True, text=True
        )
        assert ran.returncode == 0, ran.stderr
        assert (record / f"fakepython.{worker}.argv").read_text().splitlines() == [
            "-m",
            "librarian_jax.main",
            "--config=configs/grpo.py:qwen3_5_4b",
            "--config.train.num_steps=3",
            "--note=it's a test",
        ]
        assert _read_env(record / f"fakepython.{worker}.env") == {
            "EXTRA_FLAGS": "--a=1 --b",
            "JAX_COORDINATOR_ADDRESS": "10.0.0.7:8476",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": worker,
        }
    # A worker whose metadata server does not answer stops with a message instead of running as process "".
    env = _env(fake_bin, FAKE_WORKER="")
    ran = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
    assert ran.returncode == 1 and "agent-worker-number" in ran.stderr


def test_tpu_pod_copy_repo_and_missing_arguments(fake_bin):
    args = ("--tpu=t", "--zone=z", "--workers=10.1.1.1", "--copy-repo", "--dry-run")
    dry = _run(TPU, *args, env=_env(fake_bin))
    lines = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert [cmd[4] for cmd in lines] == ["ssh", "scp", "ssh"]
    assert "JAX_COORDINATOR_ADDRESS=10.1.1.1:8476 JAX_NUM_PROCESSES=1" in lines[2][-1]
    assert lines[1][5:8] == ["--recurse", f"{ROOT}/.", "t:~/librarian_jax"]
    installed = _run(TPU, *args, "--install", "--python=/venv/bin/python", env=_env(fake_bin))
    lines = [shlex.split(line) for line in installed.stdout.splitlines()]
    assert [cmd[4] for cmd in lines] == ["ssh", "scp", "ssh", "ssh"]
    assert lines[2][-1] == "--command=cd ~/librarian_jax && /venv/bin/python -m pip install -e '.[tpu]'"
    missing = _run(TPU, "--dry-run", env=_env(fake_bin))
    assert missing.returncode == 2 and "missing --tpu" in missing.stderr and "--zone" in missing.stderr
    assert _run(TPU, "--tpu=t", "--zone=z", "--env=bad", env=_env(fake_bin)).returncode == 2


def test_gpu_local_processes_get_their_jax_variables(fake_bin):
    py = str(fake_bin / "fakepython")
    done = _run(GPU, "--local=3", f"--python={py}", "--port=23456", "--", "--x=1", env=_env(fake_bin))
    assert done.returncode == 0, done.stderr
    record = fake_bin.parent / "record"
    for i in range(3):
        assert _read_env(record / f"fakepython.{i}.env") == {
            "JAX_COORDINATOR_ADDRESS": "localhost:23456",
            "JAX_LOCAL_DEVICE_IDS": str(i),
            "JAX_NUM_PROCESSES": "3",
            "JAX_PROCESS_ID": str(i),
        }
        argv = (record / f"fakepython.{i}.argv").read_text().splitlines()
        assert argv == ["-m", "librarian_jax.main", "--config=configs/grpo.py", "--x=1"]


def test_gpu_local_failure_stops_the_others(fake_bin):
    py = str(fake_bin / "fakepython")
    done = _run(GPU, "--local=3", f"--python={py}", env=_env(fake_bin, FAIL_ID="1", SLEEP="60"))
    assert done.returncode == 3
    assert "exited with status 3" in done.stderr
    # Processes 0 and 2 were stopped (the launcher waited for them) before their sleep finished.
    assert not list((fake_bin.parent / "record").glob("*.finished"))


def test_gpu_slurm_mode_runs_one_task_per_node(fake_bin):
    py = str(fake_bin / "fakepython")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2"}
    dry = _run(GPU, f"--python={py}", "--dry-run", "--", "--y=2", env=_env(fake_bin, **slurm))
    assert dry.returncode == 0, dry.stderr
    assert "GPU_MULTINODE_COORDINATOR=gpu01:12355 srun --nodes=2 --ntasks-per-node=1" in dry.stdout
    done = _run(GPU, f"--python={py}", "--env=EXTRA_X=1", "--", "--y=2", env=_env(fake_bin, **slurm))
    assert done.returncode == 0, done.stderr
    record = fake_bin.parent / "record"
    for i in range(2):
        env = _read_env(record / f"fakepython.{i}.env")
        assert env == {
            "EXTRA_X": "1",
            "JAX_COORDINATOR_ADDRESS": "gpu01:12355",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        argv = (record / f"fakepython.{i}.argv").read_text().splitlines()
        assert argv == ["-m", "librarian_jax.main", "--config=configs/grpo.py", "--y=2"]


def test_gpu_manual_mode_and_bad_arguments(fake_bin):
    dry = _run(
        GPU, "--coordinator=node0:999", "--num-processes=4", "--process-id=3", "--dry-run", env=_env(fake_bin)
    )
    assert dry.returncode == 0, dry.stderr
    assert shlex.split(dry.stdout) == [
        "env", "JAX_COORDINATOR_ADDRESS=node0:999", "JAX_NUM_PROCESSES=4", "JAX_PROCESS_ID=3",
        "python3", "-m", "librarian_jax.main", "--config=configs/grpo.py",
    ]  # fmt: skip
    for args, message in [
        ((), "no SLURM allocation"),
        (("--coordinator=node0", "--num-processes=2", "--process-id=0"), "HOST:PORT"),
        (("--coordinator=n:1", "--num-processes=2", "--process-id=2"), "--process-id must be in [0, 2)"),
        (("--coordinator=n:1", "--num-processes=2"), "needs all of"),
        (("--local=0",), "--local must be >= 1"),
        (("--local=2", "--port=http"), "--port must be a number"),
    ]:
        done = _run(GPU, *args, env=_env(fake_bin))
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_gpu_local_mode_starts_a_real_two_process_jax_run(tmp_path):
    """Two real JAX processes (CPU) started by the launcher find each other through the coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    probe = tmp_path / "python"
    code = (
        "import os, jax; e = os.environ; "
        "jax.distributed.initialize(e['JAX_COORDINATOR_ADDRESS'], int(e['JAX_NUM_PROCESSES']), "
        "int(e['JAX_PROCESS_ID'])); "
        "open(os.path.join(os.environ['OUT'], str(jax.process_index())), 'w')"
        ".write(f'{jax.process_count()} {os.environ[\"JAX_PROCESS_ID\"]}')"
    )
    # Stands in for the interpreter: ignores `-m librarian_jax.main ...` and runs the probe instead.
    probe.write_text(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)}\n")
    probe.chmod(0o755)
    env = {"JAX_PLATFORMS": "cpu", "OUT": str(tmp_path), "PATH": os.environ["PATH"]}
    done = _run(GPU, "--local=2", f"--python={probe}", f"--port={port}", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "0").read_text() == "2 0" and (tmp_path / "1").read_text() == "2 1"
