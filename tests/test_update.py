"""Incremental update (issue 42): an old exported workspace and a changed corpus -> a NEW exported workspace.

Each change kind (add, remove, modify, a change under a merged file, a rename) runs the update episode through
the real protocol (`run_batch`, `BuilderAgent`, extractive executor) with a scripted builder that reads its
update prompt; then: the old directory is byte for byte as it was, every synthetic file that rests on nothing
changed is byte-identical in the new export, and every synthetic file of the new export either cites raw
documents whose hashes are those of `raw_docs/` now or is listed as stale in the manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from librarian_jax.agents.builder import BuilderConfig
from librarian_jax.agents.protocol import format_call
from librarian_jax.agents.runtime import FROZEN, POLICY
from librarian_jax.bench import update as B
from librarian_jax.data import synthetic as S
from librarian_jax.data.mutate import mutate_task
from librarian_jax.data.schema import CorpusTask, Document
from librarian_jax.rollout import RolloutConfig, run_batch
from librarian_jax.testing import ByteTokenizer, ScriptedEngine, chat_template
from librarian_jax.workspace import (
    UPDATE_META,
    ExportError,
    SnapshotError,
    Workspace,
    carry_over,
    diff_corpus,
    load_export,
)

TOK = ByteTokenizer()
TPL = chat_template(TOK)

DOCS = [
    Document("a", "Orlen Vask works at the Amber Institute.\n", title="Profile: Orlen Vask"),
    Document("b", "The Amber Institute is in Tarn.\n", title="About the Amber Institute"),
    Document("c", "Tarn lies on the river Oss.\n", title="About Tarn"),
    Document("d", "Mira Holt studies tides.\n", title="Profile: Mira Holt"),
    Document("e", "The river Oss floods in spring.\n", title="About the river Oss"),
]


def old_workspace() -> Workspace:
    """cluster_0001 <- a; cluster_0002 <- b; merge_0001 = {cluster_0001, cluster_0002}; cluster_0003 <- c,
    merge_0001; cluster_0004 <- d; cluster_0005 <- e; cluster_0006 <- c, e."""
    ws = Workspace.from_documents(DOCS)
    raw = [d.path for d in ws.raw_docs]
    assert ws.create_file("Orlen Vask", [raw[0]], "Orlen Vask: Amber Institute.", turn=1).ok
    assert ws.create_file("Amber Institute", [raw[1]], "Amber Institute: in Tarn.", turn=1).ok
    assert ws.merge_files("People and places", ["cluster_0001", "cluster_0002"], "Vask, Amber.", turn=2).ok
    assert ws.create_file("Tarn", [raw[2], "merge_0001"], "Tarn: on the Oss.", turn=3).ok
    assert ws.create_file("Mira Holt", [raw[3]], "Mira Holt: tides.", turn=3).ok
    assert ws.create_file("River Oss", [raw[4]], "Oss: floods in spring.", turn=4).ok
    assert ws.create_file("Waters", [raw[2], raw[4]], "Tarn and the Oss.", turn=4).ok
    assert ws.check_invariants() == []
    return ws


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _section(prompt: str, head: str) -> list[str]:
    """The '- ' lines after the line starting with `head` in the builder's update prompt."""
    lines = prompt.split(head, 1)[1].splitlines()[1:]
    out = []
    for line in lines:
        if not line.startswith("- "):
            break
        out.append(line[2:])
    return out


def rewriting_builder(rewrite: bool = True):
    """A scripted update builder: turn 0 reads its prompt; with `rewrite` it deletes every stale file and
    writes one file per added or modified document (from the new raw path the prompt names); then stops."""

    def policy(session) -> str:
        prompt = session.text()
        assert "This is an UPDATE" in prompt
        if session.turns > 0 or not rewrite:
            return format_call("stop")
        stale = [s.split(" ", 1)[0] for s in _section(prompt, "Stale synthetic files")]
        calls = []
        for line in _section(prompt, "What changed"):
            m = re.match(r"(added|modified): (?:\S+ is now )?(\S+) \(doc_id (\S+)\)", line)
            if m:
                calls.append(format_call("create_file", {"title": f"Notes on {m.group(3)}",
                                                         "input_paths": [m.group(2)]}))
        if stale:
            calls.append(format_call("delete", {"target_paths": stale, "reason": "stale"}))
        return "\n".join([*calls, format_call("stop")])

    return policy


def _config() -> RolloutConfig:
    return RolloutConfig(
        builder=BuilderConfig(max_turns=30, executor="extractive", compaction="none"),
        max_probes=0, probe_at_start=False, terminal_questions="hidden", use_model_judge=False,
    )


def update(tmp_path: Path, new_docs: list[Document], rewrite: bool = True, max_turns: int = 3):
    """Export the old workspace, update it through an episode, export the result; check the old directory is
    untouched. Returns (start, new workspace, old manifest, new manifest, record)."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    assert old_workspace().export(old_dir).ok
    before = tree_hashes(old_dir)
    start = carry_over(load_export(old_dir).workspace, new_docs, max_turns=max_turns)
    task = CorpusTask("t", tuple(new_docs), meta={UPDATE_META: start})
    engine = ScriptedEngine(TOK, rewriting_builder(rewrite))
    (rec,) = run_batch([task], 1, {POLICY: engine, FROZEN: engine}, TOK, _config(), 0, template=TPL)
    assert rec.num_turns <= max_turns
    ws = Workspace.from_dict(rec.workspace_snapshots["final"], docs=new_docs)
    assert ws.check_invariants() == []
    assert ws.export(new_dir).ok
    assert tree_hashes(old_dir) == before  # the old directory is left exactly as it was
    assert load_export(new_dir).workspace == ws  # the new export loads back to the same workspace
    old_m = json.loads((old_dir / "manifest.json").read_text())
    new_m = json.loads((new_dir / "manifest.json").read_text())
    check_provenance(new_dir, new_m)
    return start, ws, old_m, new_m, rec


def check_provenance(root: Path, manifest: dict) -> None:
    """Every active synthetic file cites raw files that exist with the hashes it names, or is stale."""
    current = {d["path"]: d["sha256_16"] for d in manifest["raw_docs"]}
    for d in manifest["raw_docs"]:
        assert hashlib.sha256((root / d["path"]).read_bytes()).hexdigest() == d["sha256"]
    stale = {s["path"] for s in manifest.get("stale", [])}
    for n in manifest["synthetic"]:  # history/ included
        ok = all(current.get(p["path"]) == p["sha256_16"] for p in n["raw_provenance"])
        assert ok or n["path"] in stale, n["path"]
        assert not (ok and n["path"] in stale), n["path"]


def unaffected_identical(old_dir: Path, new_dir: Path, old_m: dict, touched_doc_ids: set[str]) -> int:
    """Every old synthetic file resting on no touched document is byte-identical in the new export."""
    doc_of = {d["path"]: d["doc_id"] for d in old_m["raw_docs"]}
    n = 0
    for node in old_m["synthetic"]:
        if {doc_of[p["path"]] for p in node["raw_provenance"]} & touched_doc_ids:
            continue
        assert (new_dir / node["path"]).read_bytes() == (old_dir / node["path"]).read_bytes(), node["path"]
        n += 1
    return n


def stale_paths(manifest: dict) -> set[str]:
    """The active stale files (the manifest also lists deleted ones, under history/)."""
    return {s["path"] for s in manifest.get("stale", []) if s["active"]}


# ------------------------------------------------------------------------------------------- change kinds
def test_added_document_gets_a_file_and_nothing_else_changes(tmp_path):
    new = [*DOCS, Document("f", "Ada Lind paints harbours.\n", title="Profile: Ada Lind")]
    start, ws, old_m, new_m, _ = update(tmp_path, new)
    assert start.changes.added == ("f",) and start.stale == ()
    assert unaffected_identical(tmp_path / "old", tmp_path / "new", old_m, set()) == 7  # every old file
    assert "raw_docs/raw_0006__profile_ada_lind.txt" in {d["path"] for d in new_m["raw_docs"]}
    (made,) = [n for n in new_m["synthetic"] if n["title"] == "Notes on f"]
    assert made["raw_sources"] == ["raw_docs/raw_0006__profile_ada_lind.txt"]
    assert "retired_raw_docs" not in new_m and stale_paths(new_m) == set()


def test_removed_document_is_gone_and_its_files_are_stale_until_deleted(tmp_path):
    new = [d for d in DOCS if d.doc_id != "d"]
    start, ws, old_m, new_m, _ = update(tmp_path / "keep", new, rewrite=False)
    assert start.changes.removed == ("d",)
    assert [s["path"] for s in start.stale] == ["cluster_0004__mira_holt.txt"]
    assert not (tmp_path / "keep/new/raw_docs/raw_0004__profile_mira_holt.txt").exists()
    assert stale_paths(new_m) == {"cluster_0004__mira_holt.txt"}  # left by the builder: marked stale
    assert new_m["retired_raw_docs"][0]["retired"] == "removed"
    assert unaffected_identical(tmp_path / "keep/old", tmp_path / "keep/new", old_m, {"d"}) == 6
    # a builder that deletes it: nothing stale; the file is in history/, not active
    _, ws, _, new_m, _ = update(tmp_path / "del", new)
    assert stale_paths(new_m) == set() and ws.stale_nodes() == []
    assert (tmp_path / "del/new/history/cluster_0004__mira_holt.txt").is_file()
    assert not (tmp_path / "del/new/cluster_0004__mira_holt.txt").exists()


def test_modified_document_new_version_and_stale_files_rewritten(tmp_path):
    new = [Document("e", "The river Oss freezes in winter.\n", title="About the river Oss") if d.doc_id == "e"
           else d for d in DOCS]
    start, ws, old_m, new_m, _ = update(tmp_path, new)
    assert start.changes.modified == ("e",)
    assert {s["path"] for s in start.stale} == {"cluster_0005__river_oss.txt", "cluster_0006__waters.txt"}
    # the new version is a new raw document; the old one has left raw_docs/
    paths = {d["path"] for d in new_m["raw_docs"]}
    assert "raw_docs/raw_0006__about_the_river_oss.txt" in paths
    assert "raw_docs/raw_0005__about_the_river_oss.txt" not in paths
    (made,) = [n for n in new_m["synthetic"] if n["title"] == "Notes on e"]
    assert made["raw_provenance"][0]["path"] == "raw_docs/raw_0006__about_the_river_oss.txt"
    assert stale_paths(new_m) == set()  # both stale files deleted, a fresh one written
    assert unaffected_identical(tmp_path / "old", tmp_path / "new", old_m, {"e"}) == 5


def test_stale_file_kept_is_byte_identical_and_cites_the_old_hash(tmp_path):
    new = [Document("e", "The river Oss freezes in winter.\n", title="About the river Oss") if d.doc_id == "e"
           else d for d in DOCS]
    _, ws, old_m, new_m, _ = update(tmp_path, new, rewrite=False)
    for p in ("cluster_0005__river_oss.txt", "cluster_0006__waters.txt"):
        assert (tmp_path / "new" / p).read_bytes() == (tmp_path / "old" / p).read_bytes()
    assert stale_paths(new_m) == {"cluster_0005__river_oss.txt", "cluster_0006__waters.txt"}
    (s,) = [s for s in new_m["stale"] if s["path"] == "cluster_0006__waters.txt"]
    assert s["changed"] == ["e"] and s["removed"] == []


def test_change_under_a_merged_file_makes_its_ancestors_and_citers_stale(tmp_path):
    new = [Document("b", "The Amber Institute moved to Vell.\n", title="About the Amber Institute")
           if d.doc_id == "b" else d for d in DOCS]
    start, ws, old_m, new_m, _ = update(tmp_path, new, rewrite=False)
    assert {s["path"] for s in start.stale} == {
        "merge_0001__people_and_places/cluster_0002__amber_institute.txt",
        "merge_0001__people_and_places/summary.txt",  # the merged directory rests on it
        "cluster_0003__tarn.txt",  # cites the merged directory
    }
    # the sibling under the same merge rests on nothing changed: byte-identical, not stale
    sib = "merge_0001__people_and_places/cluster_0001__orlen_vask.txt"
    assert (tmp_path / "new" / sib).read_bytes() == (tmp_path / "old" / sib).read_bytes()
    assert sib not in stale_paths(new_m)
    assert unaffected_identical(tmp_path / "old", tmp_path / "new", old_m, {"b"}) == 4
    # the rewriting builder deletes all three (the directory's children move up) and writes a fresh file
    _, ws, _, new_m, _ = update(tmp_path / "rw", new)
    assert stale_paths(new_m) == set()
    assert (tmp_path / "rw/new/cluster_0001__orlen_vask.txt").is_file()  # moved up out of the deleted dir


def test_renamed_document_keeps_its_file_and_nothing_is_stale(tmp_path):
    new = [Document("c-renamed", d.text, title="Tarn, renamed") if d.doc_id == "c" else d for d in DOCS]
    start, ws, old_m, new_m, rec = update(tmp_path, new)
    assert start.changes.renamed == (("c", "c-renamed"),) and start.changes.removed == ()
    assert start.stale == () and stale_paths(new_m) == set()
    assert unaffected_identical(tmp_path / "old", tmp_path / "new", old_m, set()) == 7  # every file
    (raw,) = [d for d in new_m["raw_docs"] if d["doc_id"] == "c-renamed"]
    assert raw["path"] == "raw_docs/raw_0003__about_tarn.txt" and raw["title"] == "Tarn, renamed"
    assert rec.num_turns == 1  # nothing to rewrite: the builder stopped at once


def test_no_change_exports_the_same_tree(tmp_path):
    old = old_workspace()
    start = carry_over(old, DOCS)
    assert start.changes.empty and start.stale == () and start.workspace == old
    assert old.export(tmp_path / "a").ok and start.workspace.export(tmp_path / "b").ok
    assert tree_hashes(tmp_path / "a") == tree_hashes(tmp_path / "b")


def test_diff_corpus_pairs_renames_by_hash_and_counts():
    old = Workspace.from_documents(DOCS).raw_docs
    new = [DOCS[0], Document("b2", DOCS[1].text), Document("c", "changed"), Document("z", DOCS[3].text),
           Document("q", "brand new")]
    ch = diff_corpus(old, new)
    assert ch.renamed == (("b", "b2"), ("d", "z"))
    assert ch.modified == ("c",) and ch.removed == ("e",) and ch.added == ("q",) and ch.unchanged == 1
    assert ch.counts() == {"added": 1, "removed": 1, "modified": 1, "renamed": 2, "unchanged": 1}


def test_update_of_an_update_keeps_handles_increasing_and_snapshots_round_trip():
    ws = old_workspace()
    s1 = carry_over(ws, [Document("e", "v2"), *DOCS[:4]])
    s2 = carry_over(s1.workspace, [Document("e", "v3"), *DOCS[:3]])
    w = s2.workspace
    assert [d.handle for d in w.raw_docs] == ["raw_0001", "raw_0002", "raw_0003", "raw_0007"]
    # d (removed) and e's first version stay, cited; e's second version, cited by nothing, is dropped
    assert {d.handle: d.meta["retired"] for d in w.retired_docs} == {"raw_0004": "removed",
                                                                      "raw_0005": "modified"}
    assert not w.read_file("raw_docs/raw_0005__about_the_river_oss.txt").ok
    assert w.check_invariants() == []
    assert Workspace.from_json(w.to_json()) == w
    assert Workspace.from_json(w.to_json(include_raw_text=False), docs=[Document("e", "v3"), *DOCS[:3]]) == w


def test_update_refuses_a_bad_corpus():
    with pytest.raises(ValueError, match="duplicate doc_id"):
        carry_over(old_workspace(), [DOCS[0], DOCS[0]])


def test_update_prompt_lists_changes_and_stale_files():
    new = [Document("e", "v2", title="About the river Oss"), *DOCS[:3],
           Document("f", "new", title="F")]
    start = carry_over(old_workspace(), new, max_turns=5)
    f = start.prompt_fields()
    assert f["changes"].splitlines() == [
        "- added: raw_docs/raw_0007__f.txt (doc_id f)",
        "- modified: raw_docs/raw_0005__about_the_river_oss.txt is now "
        "raw_docs/raw_0006__about_the_river_oss.txt (doc_id e)",
        "- removed: raw_docs/raw_0004__profile_mira_holt.txt (doc_id d)",
    ]
    assert f["stale"].splitlines() == [  # each with its sources as they are now
        '- cluster_0004__mira_holt.txt "Mira Holt" from (nothing left) (removed: d)',
        '- cluster_0005__river_oss.txt "River Oss" from raw_docs/raw_0006__about_the_river_oss.txt '
        '(changed: e)',
        '- cluster_0006__waters.txt "Waters" from raw_docs/raw_0003__about_tarn.txt, '
        'raw_docs/raw_0006__about_the_river_oss.txt (changed: e)',
    ]
    assert f["max_turns"] == "5" and f["num_stale"] == "3"
    assert os.path.basename(start.paths["f"]) == "raw_0007__f.txt"


# ------------------------------------------------------------------------------------ measurement pieces
def test_mutate_task_is_seeded_and_asks_what_the_new_corpus_says():
    t = S.generate_task(0, 1, S.WorldConfig(docs_per_task=6, min_words=40, max_words=80))
    m = mutate_task(t, 0, 0.2, 6)
    assert m == mutate_task(t, 0, 0.2, 6) and m.task.documents != mutate_task(t, 1, 0.2, 6).task.documents
    assert (len(m.changed), len(m.removed), len(m.added)) == (1, 1, 1) and m.added == ("u000",)
    old = {d.doc_id: d.text for d in t.documents}
    new = {d.doc_id: d.text for d in m.task.documents}
    assert set(m.removed).isdisjoint(new) and all(new[c] != old[c] for c in m.changed)
    assert all(new[d] == old[d] for d in new if d not in (*m.changed, *m.added))
    ch = diff_corpus(Workspace.from_documents(list(t.documents)).raw_docs, m.task.documents)
    assert (ch.modified, ch.removed, ch.added) == (m.changed, m.removed, m.added)
    facts = {(s, r): o for d in m.task.documents for s, r, o in S.extract_facts(d.text)}
    for q in m.task.questions:  # each question parses, and the new corpus answers it with its gold answer
        subject, chain = S.parse_question(q.question)
        for rel in chain:
            subject = facts[(subject, rel)]
        assert subject == q.gold_answer, q.question
    assert sum(q.meta["touched"] for q in m.task.questions) == 3 and len(m.task.questions) == 6


def test_bench_update_scripted_measures_stale_rebuild_and_updated(tmp_path):
    res = B.measure(B.scripted_setup(str(tmp_path)), corpora=2, fraction=0.2, questions=6, max_turns=8,
                    seed=0)
    assert set(res["methods"]) == {"stale", "rebuild", "updated"}
    assert res["changes"] == {"added": 2, "removed": 2, "modified": 2, "renamed": 0, "unchanged": 8}
    assert res["stale_before"] > 0 and res["stale_after"] == 0  # the scripted update leaves nothing stale
    m = res["methods"]
    assert m["stale"]["tokens_mean"] == 0 and m["updated"]["tokens_mean"] > 0
    assert m["stale"]["touched"] < m["rebuild"]["touched"]  # the old workspace misses what changed
    assert "| updated |" in B.table(res)


# ------------------------------------------------------------------------------------------ update tasks
def test_update_tasks_mix_into_training_and_run_as_update_episodes():
    from configs import grpo
    from librarian_jax import inputs
    from librarian_jax.config_schema import GRPOConfig
    from librarian_jax.data.pipeline import TaskPipeline

    cfg = grpo.get_config("embedded")
    cfg.data.update(num_tasks=16, update_fraction=0.5)
    settings = GRPOConfig.parse(cfg)
    train, _ = inputs.build_tasks(settings)
    mixed = inputs.update_tasks(train, settings)
    ups = [t for t in mixed if UPDATE_META in t.meta]
    assert 0 < len(ups) < len(mixed) and all(t.task_id.endswith("~m0") for t in ups)
    assert [t.task_id for t in mixed if UPDATE_META not in t.meta] == [
        t.task_id for t in train if t.task_id + "~m0" not in {u.task_id for u in ups}]
    cfg.data.update_fraction = 0.0
    assert inputs.update_tasks(train, GRPOConfig.parse(cfg)) == train
    start = ups[0].meta[UPDATE_META]
    assert start.stale and start.max_turns == cfg.rollout.builder.max_turns
    assert sorted(d.doc_id for d in start.workspace.raw_docs) == sorted(d.doc_id for d in ups[0].documents)
    # through the task pipeline as they are (meta kept), then an episode on one: the update prompt, and the
    # terminal reward scores the regenerated questions
    batch = next(iter(TaskPipeline(mixed, tasks_per_batch=len(mixed), shuffle=False, shard_index=0,
                                   shard_count=1).iterator()))
    got = next(t for t in batch if t.task_id == ups[0].task_id)
    assert got.meta[UPDATE_META] is start
    seen = []

    def policy(session) -> str:
        seen.append(session.text())
        return format_call("stop")

    engine = ScriptedEngine(TOK, policy)
    answerer = dataclasses.replace(RolloutConfig().answerer, kind="scripted", max_turns=2)
    cfg_r = RolloutConfig(builder=BuilderConfig(max_turns=3, executor="extractive", compaction="none"),
                          max_probes=0, probe_at_start=True, terminal_questions="hidden",
                          use_model_judge=False, answerer=answerer)
    (rec,) = run_batch([got], 1, {POLICY: engine, FROZEN: engine}, TOK, cfg_r, 0, template=TPL)
    assert "This is an UPDATE" in seen[0]
    assert {a["question_id"] for a in rec.answers} == {q.question_id for q in got.questions}


@pytest.mark.slow
def test_a_grpo_step_trains_on_update_tasks(tmp_path):
    """`data.update_fraction=1`: every training task is an update task, and a GRPO step of the tiny run
    (real engines) rolls them out from their carried-over workspaces and trains on them."""
    import sys

    from librarian_jax import training
    from librarian_jax.rollout import read_jsonl

    sys.path.insert(0, os.path.dirname(__file__))
    from test_main import tiny_run_config

    cfg = tiny_run_config(str(tmp_path / "run"), num_steps=1)
    cfg.data.update_fraction = 1.0
    cfg.rollout.record_snapshots = True
    training.run(cfg)
    (rec, *_) = read_jsonl(os.path.join(tmp_path, "run", "episodes", "step_1.jsonl"))
    assert rec.task_id.endswith("~m0") and rec.segments
    final = rec.workspace_snapshots["final"]
    assert final["retired"] and final["nodes"]  # the carried-over workspace: retired documents, old files


def test_a_tampered_retired_section_is_refused(tmp_path):
    """load_export and from_dict check an update's retired documents like the live ones."""
    new = [Document("e", "v2", title="About the river Oss"), *DOCS[:4]]
    ws = carry_over(old_workspace(), new).workspace
    assert ws.export(tmp_path / "ok").ok and load_export(tmp_path / "ok").workspace == ws
    for i, (key, value) in enumerate((("handle", "raw_0001"), ("path", "../escape.txt"), ("sha256_16", 7))):
        d = tmp_path / f"bad{i}"
        assert ws.export(d).ok
        m = json.loads((d / "manifest.json").read_text())
        m["retired_raw_docs"][0][key] = value
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ExportError):
            load_export(d)
    snap = ws.to_dict()
    snap["retired"][0].update(handle="raw_0002", filename="raw_0002__x.txt")  # a live document's handle
    with pytest.raises(SnapshotError, match="bad handle, or also a live document's"):
        Workspace.from_dict(snap)
