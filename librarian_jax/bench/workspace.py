"""Workspace throughput: actions per second on a 500-document corpus holding 200 synthetic files.

    python -m librarian_jax.bench.workspace [--docs 500] [--synthetic 200] [--ops 2000] [--seed 0]

Prints one line per measurement (create / merge / delete / list / read / a realistic mix / snapshot copy /
snapshot + one write at the given size and 4x larger / to_json / from_json / readme / source_excerpts), each
as operations per second and microseconds per operation, in this process's CPU time (`time.process_time`:
the figures hold on a loaded machine). Host-only: no jax, no model.

"probe snap + create (N=...)" is what a rollout does at every probe: snapshot the workspace (the
probe reads the snapshot) and go on writing to the workspace. Snapshots share the path index (persistent
maps, `immutables.Map`), so its cost should not grow with N.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from absl import app, flags

from librarian_jax.data.schema import Document
from librarian_jax.workspace import Workspace

_DOCS = flags.DEFINE_integer("docs", 500, "raw documents in the corpus")
_SYN = flags.DEFINE_integer("synthetic", 200, "synthetic files and directories built before timing")
_OPS = flags.DEFINE_integer("ops", 2000, "operations per measurement")
_SEED = flags.DEFINE_integer("seed", 0, "random seed")

_WORDS = (
    "harbour tide bridge river archive ledger council survey railway census comet lantern quarry orchard "
    "treaty mill canal beacon glacier market"
).split()


def make_corpus(n: int, rng: random.Random) -> list[Document]:
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choices(_WORDS, k=rng.randint(8, 18))) for _ in range(rng.randint(20, 80))]
        docs.append(
            Document(f"doc-{i:05d}", "\n".join(lines), title=f"{rng.choice(_WORDS).title()} record {i}")
        )
    return docs


def build(docs: list[Document], n_syn: int, rng: random.Random) -> Workspace:
    """`n_syn` synthetic nodes: about 3/4 files from 2-5 sources, 1/4 directories merging 2-4 nodes."""
    ws = Workspace.from_documents(docs)
    made = 0
    while made < n_syn:
        active = [n.node_id for n in ws.active_nodes()]
        if len(active) >= 4 and rng.random() < 0.25:
            kids = rng.sample(active, rng.randint(2, min(4, len(active))))
            r = ws.merge_files(f"Group {made}", [ws.path_of(k) for k in kids], "summary " * 40, turn=made)
        else:
            srcs = [f"raw_{rng.randint(1, len(docs)):04d}" for _ in range(rng.randint(2, 5))]
            if active and rng.random() < 0.3:
                srcs.append(ws.path_of(rng.choice(active)))
            r = ws.create_file(f"Topic {made}", srcs, "body line\n" * 30, turn=made)
        made += r.ok
    return ws


def timed(name: str, n: int, fn: Callable[[int], object]) -> float:
    t0 = time.process_time()
    for i in range(n):
        fn(i)
    dt = time.process_time() - t0
    print(f"{name:<34} {n / dt:>12,.0f} ops/s {1e6 * dt / n:>10,.1f} us/op   (n={n})")
    return n / dt


def main(argv: list[str]) -> None:
    del argv
    rng = random.Random(_SEED.value)
    docs = make_corpus(_DOCS.value, rng)
    t0 = time.perf_counter()
    base = build(docs, _SYN.value, rng)
    print(f"built {base.stats()} in {time.perf_counter() - t0:.2f}s")
    n = _OPS.value
    raw_paths = [d.path for d in base.raw_docs]
    file_paths = [base.file_path_of(x.node_id) for x in base.active_nodes()]
    dir_paths = [base.path_of(x.node_id) for x in base.active_nodes() if x.kind == "directory"] + [
        "raw_docs",
        ".",
    ]

    ws = base.copy()
    timed(
        "create_file",
        n,
        lambda i: ws.create_file(f"Bench {i}", rng.sample(raw_paths, 3), "text\n" * 20, turn=i),
    )
    ws = base.copy()
    created = [
        ws.create_file(f"Bench {i}", rng.sample(raw_paths, 2), "x", turn=i).data["path"] for i in range(n)
    ]
    timed(
        "merge_files (2 files)",
        n // 2,
        lambda i: ws.merge_files(f"Pair {i}", created[2 * i : 2 * i + 2], "pair", turn=i),
    )
    ws = base.copy()
    created = [
        ws.create_file(f"Bench {i}", rng.sample(raw_paths, 2), "x", turn=i).data["path"] for i in range(n)
    ]
    timed("delete", n, lambda i: ws.delete([created[i]], "bench", turn=i))
    timed("list_dir", n, lambda i: base.list_dir(rng.choice(dir_paths)))
    timed("read_file", n, lambda i: base.read_file(rng.choice(raw_paths + file_paths)))
    timed(
        "read_file (forgiving name)",
        n,
        lambda i: base.read_file(rng.choice(file_paths).rsplit("/", 1)[-1][:-4]),
    )

    ws = base.copy()
    live: list[str] = []

    def mixed(i: int) -> None:
        x = rng.random()
        if x < 0.45:
            ws.read_file(rng.choice(raw_paths + file_paths))
        elif x < 0.65:
            ws.list_dir(rng.choice(dir_paths))
        elif x < 0.85:
            r = ws.create_file(f"Mix {i}", rng.sample(raw_paths, 3), "text\n" * 20, turn=i)
            live.append(r.data["path"])
        elif x < 0.93 and len(live) >= 2:
            r = ws.merge_files(f"MixDir {i}", [live.pop(), live.pop()], "summary", turn=i)
        elif live:
            ws.delete([live.pop()], "mix", turn=i)

    timed("mix (45r/20l/20c/8m/7d)", n, mixed)
    timed("copy (snapshot)", n, lambda i: base.copy())
    timed(
        "copy + create on the copy",
        n // 4,
        lambda i: base.copy().create_file(f"Snap {i}", rng.sample(raw_paths, 2), "x", turn=i),
    )
    for scale in (1, 4):
        big = base if scale == 1 else build(docs, scale * _SYN.value, rng)
        n_syn = len(big.nodes)
        ws = big.copy()
        ws.list_dir(".")  # the index exists, as in a rollout

        def probe_then_write(i: int, ws: Workspace = ws) -> None:
            snap = ws.copy()
            snap.read_file(raw_paths[i % len(raw_paths)])  # the probe reads the snapshot
            ws.create_file(f"Probe {i}", rng.sample(raw_paths, 2), "x", turn=i)

        timed(f"probe snap + create (N={n_syn})", max(2, n // 4), probe_then_write)
    s = base.to_json()
    print(f"snapshot JSON: {len(s) / 1e6:.2f} MB")
    timed("to_json", max(10, n // 50), lambda i: base.to_json())
    small = base.to_json(include_raw_text=False)
    print(f"snapshot JSON without raw texts: {len(small) / 1e3:.0f} kB")
    timed("to_json(include_raw_text=False)", n // 5, lambda i: base.to_json(include_raw_text=False))
    timed("from_json", max(10, n // 100), lambda i: Workspace.from_json(s))
    timed("readme", max(10, n // 10), lambda i: base.readme())
    timed("source_excerpts (4 src)", n // 2, lambda i: base.source_excerpts(rng.sample(raw_paths, 4)))


if __name__ == "__main__":
    app.run(main)
