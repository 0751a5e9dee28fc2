"""Incremental update vs full rebuild vs the stale workspace, on mutated embedded-world corpora (issue 42).

    python -m librarian_jax.bench.update                       # scripted builders (no model), 16 corpora
    python -m librarian_jax.bench.update --run=/tmp/librarian_jax/grpo   # a trained run's builder

For each held-out corpus of the classic embedded world (`configs/grpo.py:embedded`'s data; the run's held-out
split with `--run`): the builder builds a workspace (the OLD one); the corpus is mutated
(`data.mutate.mutate_task`: a seeded `--fraction` of the documents removed, as many changed, as many added;
`--questions` questions asked again from the NEW corpus, half of them supported by a changed or added
document); then three workspaces of the new corpus are answered by the run's answerer (the classic preset's:
the scripted navigator):

- `stale`: the old workspace left as it was (its raw documents the old ones; no construction tokens);
- `rebuild`: a full build of the new corpus;
- `updated`: the old workspace carried over (`workspace.carry_over`) and an update episode
  (`--update_max_turns`), as `build --config.update_from` runs it.

Builders: `--run=DIR` restores the run's builder (greedy) and answers with the run's protocol
(`eval.cli.eval_cluster`); without it, a scripted builder (`--style`, a warm-start demonstration style,
default `own_doc`: one file per entity document) builds through the real protocol (`testing.ScriptedEngine`),
and its update episode deletes each stale file and writes it again under its title from its sources as they
are now (the update prompt lists them), and gives each added document (and a changed one no rewrite covers)
its own file. History compaction is off for scripted builders (their plans read the first prompt).
Construction tokens are counted as the eval command counts them (`EpisodeRecord.construction_tokens`) with
the run's tokenizer (the embedded SentencePiece without `--run`).

Prints a table (accuracy overall / on touched / on untouched questions, construction tokens per corpus,
stale files left) and the paired differences to the rebuild with 95% bootstrap CIs over corpora; `--out`
writes it all as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

import numpy as np
from absl import app, flags, logging

from librarian_jax import cluster, config_validation, inputs, tokenizers
from librarian_jax.agents.protocol import format_call
from librarian_jax.agents.runtime import ANSWERER, FROZEN, FROZEN_ROLES, POLICY
from librarian_jax.data.mutate import mutate_task
from librarian_jax.eval import cli, pipeline, restore, stats
from librarian_jax.presets import eval as eval_presets
from librarian_jax.presets import grpo as grpo_presets
from librarian_jax.testing import FakeSession, ScriptedEngine
from librarian_jax.warm_start.demos import listed_docs, scripted_builder
from librarian_jax.workspace import UPDATE_META, carry_over

_RUN = flags.DEFINE_string("run", "", "a training workdir whose builder to use ('' = a scripted builder)")
_STEP = flags.DEFINE_integer("step", -1, "the run's checkpoint step (-1 = newest)")
_STYLE = flags.DEFINE_string("style", "own_doc", "the scripted builder's style (warm_start.demos.STYLES)")
_CORPORA = flags.DEFINE_integer("corpora", 16, "held-out corpora")
_FRACTION = flags.DEFINE_float("fraction", 0.2, "fraction of documents removed, changed and added (each)")
_QUESTIONS = flags.DEFINE_integer("questions", 6, "questions per mutated corpus (half touched)")
_TURNS = flags.DEFINE_integer("update_max_turns", 8, "the update episode's turn budget")
_SEED = flags.DEFINE_integer("seed", 0, "mutation and episode seed")
_DOCS = flags.DEFINE_integer("docs_per_task", 0, "scripted: documents per corpus (0 = configs/grpo.py's 6)")
_BUILD_TURNS = flags.DEFINE_integer("build_max_turns", 0, "scripted: a full build's turns (0 = the config's)")
_ANSWER_TURNS = flags.DEFINE_integer("answerer_max_turns", 0, "scripted: the navigator's turns (0 = config)")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/librarian_jax/bench_update", "tokenizer cache (scripted)")
_OUT = flags.DEFINE_string("out", "", "write the results as JSON here")

METHODS = ("stale", "rebuild", "updated")
UPDATE_MARK = "This is an UPDATE"  # the first words of agents/prompts/builder_update.txt
CALLS_PER_TURN = 3
REPLY_CHARS = 300  # a scripted update reply's calls fit the embedded builder's 240 new tokens


def pack_replies(calls: list[str]) -> list[str]:
    """Calls into replies of at most CALLS_PER_TURN calls and REPLY_CHARS characters (at least one call)."""
    replies: list[list[str]] = []
    for c in calls:
        last = replies[-1] if replies else None
        if last is None or len(last) == CALLS_PER_TURN or sum(map(len, last)) + len(c) > REPLY_CHARS:
            replies.append([c])
        else:
            last.append(c)
    return ["\n".join(r) for r in replies]


def _section(prompt: str, head: str) -> list[str]:
    lines = prompt.split(head, 1)[1].splitlines()[1:] if head in prompt else []
    out = []
    for line in lines:
        if not line.startswith("- "):
            break
        out.append(line[2:])
    return out


_STALE_LINE = re.compile(
    r'^(?P<path>\S+) "(?P<title>[^"]*)" from (?P<sources>.*?)(?: \((?:changed|removed): .*)?$')


def stale_paths(prompt: str) -> list[str]:
    return [s.split(" ", 1)[0] for s in _section(prompt, "Stale synthetic files")]


def scripted_update_calls(prompt: str) -> list[str]:
    """The scripted update builder's calls, from its prompt alone: delete the stale files (two a call); write
    each stale file again under its title from its sources as they are now (as the prompt lists them, stale
    ones left out); give each added or changed document no rewrite covers a file of its own when its title
    names an entity (the `own_doc` style); stop."""
    docs = {d.doc_id: d for d in listed_docs(prompt)}
    lines = _section(prompt, "Stale synthetic files")
    stale = stale_paths(prompt)
    calls = [format_call("delete", {"target_paths": stale[i : i + 2], "reason": "stale"})
             for i in range(0, len(stale), 2)]
    covered: set[str] = set()
    for line in lines:
        m = _STALE_LINE.match(line)
        if m is None or m.group("sources") == "(nothing left)":
            continue
        sources = [p for p in m.group("sources").split(", ") if p not in stale]
        if sources:
            calls.append(format_call("create_file", {"title": m.group("title"), "input_paths": sources}))
            covered.update(sources)
    for line in _section(prompt, "What changed"):
        kind, _, rest = line.partition(": ")
        if kind in ("added", "modified"):
            path = rest.split(" (doc_id")[0].split(" is now ")[-1]
            d = docs.get(line.rsplit("(doc_id ", 1)[1].rstrip(")"))
            if path not in covered and d is not None and d.entity:
                calls.append(format_call("create_file", {"title": d.entity, "input_paths": [d.doc_id]}))
    return [*calls, format_call("stop")]


def scripted_policy(style: str, max_turns: int) -> Any:
    """A ScriptedEngine policy: a full build in `style` (warm_start.demos), or the scripted update."""
    build = scripted_builder(style, CALLS_PER_TURN, max_turns)
    plans: dict[int, list[str]] = {}

    def policy(session: FakeSession) -> str:
        text = session.text()
        if UPDATE_MARK not in text:
            return build(session)
        if id(session) not in plans:
            plans[id(session)] = pack_replies(scripted_update_calls(text))
        return plans[id(session)][min(session.turns, len(plans[id(session)]) - 1)]

    return policy


@dataclasses.dataclass
class Setup:
    tasks: list[Any]
    tokenizer: Any
    engines: Any
    templates: dict[str, Any]
    rollout: Any
    builder: str


def scripted_setup(workdir: str, style: str = "own_doc", docs_per_task: int = 0, build_max_turns: int = 0,
                   answerer_max_turns: int = 0) -> Setup:
    """The classic embedded world (`configs/grpo.py:embedded`) with a scripted builder of `style`; 0 = the
    config's value."""
    cfg = grpo_presets.get_config("embedded")
    cfg.workdir = workdir
    cfg.rollout.builder.compaction = "none"  # the scripted plans read the first prompt
    if docs_per_task:  # a larger corpus: an answerer context that holds its first prompt (README, root)
        cfg.data.docs_per_task = docs_per_task
        cfg.rollout.answerer.context_budget = 16384
    if build_max_turns:
        cfg.rollout.builder.max_turns = build_max_turns
    if answerer_max_turns:
        cfg.rollout.answerer.max_turns = answerer_max_turns
    settings = config_validation.validate(cfg)
    train, held = inputs.build_tasks(settings)
    tok = inputs.build_tokenizer(settings, train + held)
    template = tokenizers.chat_template(tok)
    rollout = cluster.mode_rollout(settings.rollout.config, cluster.Mode.EVAL)
    rollout = dataclasses.replace(rollout, terminal_questions="hidden")
    engine = ScriptedEngine(tok, scripted_policy(style, rollout.builder.max_turns),
                            end_id=template.stop_ids[0])
    engines = {POLICY: engine, FROZEN: engine}
    templates = {POLICY: template, FROZEN: template, ANSWERER: template,
                 **dict.fromkeys(FROZEN_ROLES, template)}
    return Setup(held, tok, lambda: engines, templates, rollout, f"scripted:{style}")


def run_setup(run: str, step: int = -1) -> Setup:
    """A training run's builder (greedy) and protocol, on its held-out corpora (`eval.cli`'s restore)."""
    eval_cfg = eval_presets.get_config()
    eval_cfg.run, eval_cfg.step, eval_cfg.methods = run, step, "trained"
    plan = cli.plan_eval(eval_cfg)
    held, _ = cli.heldout_tasks(plan)
    c = plan.settings
    mesh = cluster.local_mesh(c.mesh)
    from_run = restore.run_tokenizer(plan.run_cfg, plan.run_dir, held)
    the_cluster = cli.eval_cluster(plan, cluster.Mode.EVAL, mesh, from_run)
    the_cluster.sync_weights(cli.builder_model("trained", plan, the_cluster))
    rollout = dataclasses.replace(the_cluster.rollout, terminal_questions="hidden")
    return Setup(held, from_run, lambda: the_cluster.engines, the_cluster.templates, rollout,
                 f"{plan.run_dir}@{plan.step}")


def _build(setup: Setup, method: str, tasks: list[Any], seed: int) -> list[pipeline.Built]:
    return pipeline.build_workspaces(method, tasks, setup.engines, setup.tokenizer, setup.rollout,
                                     templates=setup.templates, seed=seed, progress=False)


def measure(setup: Setup, corpora: int, fraction: float, questions: int, max_turns: int,
            seed: int) -> dict[str, Any]:  # noqa: PLR0914 - one measurement, read top to bottom
    """Builds, mutates, updates / rebuilds and answers (see the module docstring); returns the results."""
    t0 = time.perf_counter()
    tasks = setup.tasks[:corpora]
    old = _build(setup, "old", tasks, seed)
    muts = [mutate_task(t, seed, fraction, questions) for t in tasks]
    new_tasks = [m.task for m in muts]
    rebuilt = _build(setup, "rebuild", new_tasks, seed)
    starts = [carry_over(b.workspace, m.task.documents, max_turns) for b, m in zip(old, muts, strict=True)]
    upd_tasks = [dataclasses.replace(m.task, meta={**m.task.meta, UPDATE_META: s})
                 for m, s in zip(muts, starts, strict=True)]
    updated = _build(setup, "updated", upd_tasks, seed)
    t_build = time.perf_counter() - t0
    jobs = []
    for i, task in enumerate(new_tasks):
        jobs += [pipeline.Job("stale", task, old[i].workspace, 1, 0),
                 pipeline.Job("rebuild", task, rebuilt[i].workspace, 1, rebuilt[i].construction_tokens),
                 pipeline.Job("updated", task, updated[i].workspace, 1, updated[i].construction_tokens)]
    answers = pipeline.answer_jobs(jobs, setup.engines, setup.tokenizer, setup.rollout,
                                   templates=setup.templates, seed=seed, progress=False)
    per: dict[str, dict[str, list[float]]] = {m: {"all": [], "touched": [], "untouched": []} for m in METHODS}
    for job, ans in zip(jobs, answers, strict=True):
        if isinstance(ans, Exception):
            raise ans
        touched = {q.question_id: bool(q.meta.get("touched")) for q in job.task.questions}
        rows = [a for a in ans if not a.get("copy")]
        acc = per[job.method]
        acc["all"].append(float(np.mean([a["correct"] for a in rows])) if rows else 0.0)
        for key, want in (("touched", True), ("untouched", False)):
            sel = [a["correct"] for a in rows if touched[a["question_id"]] is want]
            acc[key].append(float(np.mean(sel)) if sel else float("nan"))
    tokens = {"stale": [0] * len(tasks), "rebuild": [b.construction_tokens for b in rebuilt],
              "updated": [b.construction_tokens for b in updated]}
    idx = stats.bootstrap_indices(len(tasks), seed=seed)
    out: dict[str, Any] = {
        "builder": setup.builder, "corpora": len(tasks), "fraction": fraction, "questions": questions,
        "docs_per_corpus": float(np.mean([len(t.documents) for t in tasks])),
        "build_max_turns": setup.rollout.builder.max_turns,
        "answerer": f"{setup.rollout.answerer.kind}, {setup.rollout.answerer.max_turns} turns",
        "update_max_turns": max_turns, "seed": seed,
        "changes": {k: int(sum(s.changes.counts()[k] for s in starts)) for k in starts[0].changes.counts()},
        "stale_before": int(sum(len(s.stale) for s in starts)),
        "stale_after": int(sum(len(b.workspace.stale_nodes()) for b in updated)),
        "old_tokens_mean": float(np.mean([b.construction_tokens for b in old])),
        "old_files_mean": float(np.mean([b.workspace.stats()["active_synthetic"] for b in old])),
        "methods": {},
        "build_s": t_build, "wall_s": time.perf_counter() - t0,
    }
    for m in METHODS:
        row: dict[str, Any] = {k: float(np.nanmean(v)) for k, v in per[m].items()}
        row["tokens_mean"] = float(np.mean(tokens[m]))
        if m != "rebuild":
            diff = np.array(per[m]["all"]) - np.array(per["rebuild"]["all"])
            lo, hi = stats.percentile_ci(diff[idx].mean(axis=1))
            row["minus_rebuild"] = {"mean": float(diff.mean()), "ci95": [lo, hi]}
        out["methods"][m] = row
    reb = out["methods"]["rebuild"]["tokens_mean"]
    out["methods"]["updated"]["tokens_vs_rebuild"] = out["methods"]["updated"]["tokens_mean"] / max(reb, 1.0)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        f"builder {res['builder']}, {res['corpora']} corpora of {res['docs_per_corpus']:.0f} documents, "
        f"fraction {res['fraction']} (changes "
        f"{res['changes']}), {res['questions']} questions each; stale files before the update "
        f"{res['stale_before']}, after {res['stale_after']}",
        "| workspace | accuracy | touched | untouched | construction tokens / corpus "
        "| vs rebuild (acc, 95% CI) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in METHODS:
        r = res["methods"][m]
        d = r.get("minus_rebuild")
        ci = f"{100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]" if d else "-"
        tok = f"{r['tokens_mean']:,.0f}"
        if m == "updated":
            tok += f" ({100 * r['tokens_vs_rebuild']:.0f}% of rebuild)"
        acc = f"{100 * r['all']:.1f} | {100 * r['touched']:.1f} | {100 * r['untouched']:.1f}"
        lines.append(f"| {m} | {acc} | {tok} | {ci} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    if _RUN.value:
        setup = run_setup(_RUN.value, _STEP.value)
    else:
        setup = scripted_setup(_WORKDIR.value, _STYLE.value, _DOCS.value, _BUILD_TURNS.value,
                               _ANSWER_TURNS.value)
    res = measure(setup, _CORPORA.value, _FRACTION.value, _QUESTIONS.value, _TURNS.value, _SEED.value)
    logging.info("bench.update: %s", json.dumps(res))
    print(table(res))  # noqa: T201 - the benchmark's answer
    print(f"wall {res['wall_s']:.1f} s (builds {res['build_s']:.1f} s)")  # noqa: T201
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    app.run(main)
