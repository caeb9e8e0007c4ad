"""The studies' quick modes: each writes its tables, plots and record, with finite numbers; the
results page is what ``studies/page.py`` writes from the committed outputs. The statistical
conclusions live in docs/results.md, not here."""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest
import torch
from launching import wait_until

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "studies"


def run_study(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(STUDIES / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def check_output(out: Path, plots: list[str]) -> list[dict]:
    tables = (out / "tables.md").read_text()
    assert tables.startswith("<!-- written by studies/")
    assert "| ---" in tables
    for word in ("nan", "inf |"):
        assert word not in tables.lower(), tables
    for name in plots:
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    meta = json.loads((out / "meta.json").read_text())
    assert meta["machine"]["torch"] == torch.__version__ and meta["config"]["quick"] is True
    return [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]


@pytest.mark.exhaustive
def test_linreg_quick(tmp_path):
    run_study("linreg.py", "--quick", "--out", str(tmp_path))
    runs = check_output(tmp_path, ["loss.png", "gsnr.png", "gamma.png", "k.png"])
    assert {r["sweep"] for r in runs} == {"main", "gamma", "k"}
    assert {r["optimizer"] for r in runs if r["sweep"] == "main"} == {"SGD", "VR-SGD"}
    # every grid point of the main comparison ran 100 steps; the best LR's finals are finite
    best = min((r for r in runs if r["sweep"] == "main" and r["optimizer"] == "SGD" and r["sigma"] == 0),
               key=lambda r: r["final"][0])
    assert math.isfinite(best["final"][0]) and best["final"][0] < 1.0


def test_linreg_group_gradients_equal_one_backward_per_group():
    """The study hands the optimizer its k group gradients directly (closed form): the step equals
    the one the tensor hooks give when each group is its own backward()."""
    sys.path.insert(0, str(STUDIES))
    import linreg

    import vrgd_ds

    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(64, linreg.DIM, generator=gen), torch.randn(64, generator=gen)
    k, m = 8, 8
    direct, hooked = (torch.nn.Parameter(torch.full((linreg.DIM,), 0.5)) for _ in range(2))
    opt_direct, opt_hooked = vrgd_ds.VRSGD([direct], lr=0.1), vrgd_ds.VRSGD([hooked], lr=0.1)
    source = linreg.GroupGradients()
    opt_direct.set_statistics_source(source)
    for _ in range(3):
        xs = x.view(k, m, -1)
        groups = (2.0 / m) * torch.einsum("kmd,km->kd", xs, xs @ direct.detach() - y.view(k, m))
        source.feed(direct, groups)
        opt_direct.step()
        for j in range(k):
            (((x[j * m:(j + 1) * m] @ hooked - y[j * m:(j + 1) * m]) ** 2).mean() / k).backward()
        opt_hooked.step()
        opt_hooked.zero_grad()
        torch.testing.assert_close(direct.detach(), hooked.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(direct.detach(), torch.full((linreg.DIM,), 0.5))


@pytest.mark.exhaustive  # about 8 s (make test: the page from the committed records, test_results_page_is_generated_from_the_committed_outputs)
def test_the_collapse_records_tables_are_what_its_runs_give(tmp_path):
    """``--tables-from`` writes a record's tables again from its runs, training nothing; on the
    committed record that reproduces its committed tables.md. Before, the record's tables
    predated the grid-edge marker: 7 cells whose best LR sat at the grid's edge read as
    bracketed (fails on the old record)."""
    import shutil

    record = ROOT / "docs" / "studies" / "collapse"
    copy = tmp_path / "collapse"
    shutil.copytree(record, copy)
    run_study("collapse.py", "--tables-from", str(copy))
    assert (copy / "tables.md").read_text() == (record / "tables.md").read_text()
    assert (copy / "runs.jsonl").read_bytes() == (record / "runs.jsonl").read_bytes()
    meta, before = (json.loads((d / "meta.json").read_text()) for d in (copy, record))
    assert meta["tables_rewritten"]["command"].startswith("collapse.py --tables-from")
    assert {k: v for k, v in meta.items() if k != "tables_rewritten"} == {
        k: v for k, v in before.items() if k != "tables_rewritten"}


@pytest.mark.exhaustive
def test_collapse_quick(tmp_path):
    run_study("collapse.py", "--quick", "--out", str(tmp_path))
    runs = check_output(tmp_path, ["collapse.png"])
    labels = {r["optimizer"] for r in runs}
    assert {"Momentum", "VR-Momentum", "Adam", "LAMB", "LARS", "VR-LARS"} <= labels
    assert {"VR-Adam first_moment", "VR-Adam both_moments", "VR-Adam update"} <= labels
    for r in runs:
        for seed in r["runs"]:
            assert 0.0 <= seed["test"] <= 1.0 and math.isfinite(seed["gap"])
    # a best LR at the grid's edge is marked (its optimum may lie beyond): before, nothing said so
    import re

    factors = sorted({r["factor"] for r in runs})
    rows = [line for line in (tmp_path / "tables.md").read_text().splitlines() if "(×" in line]
    assert rows
    for line in rows:
        f = float(re.search(r"\(×([0-9.]+)", line).group(1))
        assert ("grid edge" in line) == (len(factors) > 1 and f in (factors[0], factors[-1])), line


@pytest.fixture(scope="module")
def study_work(tmp_path_factory) -> Path:
    """The quick BERT studies' work directory: the embedded corpus is prepared there once."""
    return tmp_path_factory.mktemp("study_work")


@pytest.mark.slow
@pytest.mark.exhaustive  # an end-to-end smoke run of the study script (1 min): make test-all
def test_bert_batch_quick(tmp_path, study_work):
    """Two optimizers x two batches through the real job (1 CPU rank, 256 samples each)."""
    run_study("bert_batch.py", "--quick", "--work", str(study_work), "--out", str(tmp_path / "out"), timeout=900)
    runs = check_output(tmp_path / "out", ["bert_batch.png"])
    assert sorted((r["batch"], r["optimizer"]) for r in runs) == [
        (16, "LAMB"), (16, "VR-LAMB first_moment"), (64, "LAMB"), (64, "VR-LAMB first_moment")]
    for r in runs:
        assert math.isfinite(r["mlm_loss"]) and r["samples"] == 256
        assert (r["b_simple"] is None) == (r["optimizer"] == "LAMB")  # the noise scale needs the statistics
        if r["b_simple"] is not None:
            assert math.isfinite(r["b_simple"]) and r["b_simple"] > 0
    # the committed output alone reassembles the same study: nothing runs again
    run_study("bert_batch.py", "--quick", "--only-finished", "--reuse", str(tmp_path / "out"),
              "--work", str(tmp_path / "elsewhere"), "--out", str(tmp_path / "again"))
    again = check_output(tmp_path / "again", ["bert_batch.png"])
    assert [r["mlm_loss"] for r in again] == [r["mlm_loss"] for r in runs]
    assert not (tmp_path / "elsewhere" / "quick" / "runs").exists()


def test_a_record_keeps_no_machine_path_of_the_command():
    """``meta.json``'s command: absolute paths inside the checkout relative to it, scratch paths
    outside it as ``.../`` and their last part, also after ``NAME=``; the rest as typed."""
    sys.path.insert(0, str(STUDIES))
    from common import ROOT, portable

    assert portable(str(ROOT / "docs" / "studies" / "bert_plateau")) == "docs/studies/bert_plateau"
    assert portable("/tmp/scratch/bert_plateau") == ".../bert_plateau"
    assert portable("wikitext=/data/corpora/wikitext-2") == "wikitext=.../wikitext-2"
    assert [portable(a) for a in ("--work", "runs/x", "wikitext=../shared/data/wikitext-2", "--lr-factor", "0.5")] == [
        "--work", "runs/x", "wikitext=../shared/data/wikitext-2", "--lr-factor", "0.5"]


def test_a_record_marks_its_commit_when_the_data_pipelines_code_is_changed(monkeypatch, tmp_path):
    """A study's record names its commit "+uncommitted changes" where the code it ran differs from
    the commit: the data pipeline's too (its tokenizer, shards and samples make every run's data).
    Fails on the old code, whose pathspec named a folder the checkout does not have
    (``vrgd_ds.data_pipeline``): a changed sampler left the commit unmarked."""
    sys.path.insert(0, str(STUDIES))
    import common

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    monkeypatch.setattr(common, "ROOT", clone)
    assert not common.commit().endswith("+uncommitted changes")
    for folder in common.CODE:
        assert (clone / folder).is_dir(), folder
    sampler = clone / "data_pipeline" / "sampler.py"
    sampler.write_text(sampler.read_text() + "\n# changed\n")
    assert common.commit().endswith("+uncommitted changes")


def test_the_adaptive_batch_tables_leave_the_budgets_remainder_out_of_the_controllers_batches():
    """The last step of a run takes what is left of the sample budget (the job cuts the batch to
    it): its batch is not one the controller chose, and the table's range, median and changes
    leave it out. The committed record's table is what its runs give by that rule. Fails on the
    old code, which counted the remainder: the embedded corpus's seed-2 VR-LAMB run read as
    shrinking to 24 (its controller never went below 48) and a 288 → 64 remainder as a change."""
    sys.path.insert(0, str(STUDIES))
    from adaptive_batch import changes, chosen

    assert chosen([64, 56, 56, 24]) == [64, 56, 56] and changes([64, 56, 56, 24]) == 1
    assert chosen([64, 64]) == [64, 64] and chosen([64, 96]) == [64, 96] and chosen([40]) == [40]
    record = ROOT / "docs" / "studies" / "adaptive_batch"
    rows = {tuple(cells[:3]): cells for line in (record / "tables.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| corpus", "| ---"))
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    runs = [json.loads(line) for line in (record / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == len(runs) == 16
    for r in runs:
        row, b = rows[(r["corpus"], str(r["seed"]), r["optimizer"])], chosen(r["batches"])
        assert row[6] == f"{b[0]:.0f} / {min(b):.0f}–{max(b):.0f} / {median(b):.0f}" and row[7] == str(changes(r["batches"])), row
    assert "| embedded | 2 | VR-LAMB adaptive |" in (record / "tables.md").read_text()
    assert min(chosen(next(r["batches"] for r in runs if (r["corpus"], r["seed"], r["optimizer"]) ==
                           ("embedded", 2, "VR-LAMB adaptive")))) == 48


def test_a_records_command_runs_as_recorded(monkeypatch, tmp_path):
    """``meta.json``'s command is quoted as a shell needs it: an optimizer label with a space is
    one argument. Every committed ``bert_batch`` record's command parses with the study's own
    options. Fails on the old code, which joined the arguments with spaces: pasted, the command
    stopped at ``--optimizer VR-LAMB`` ("invalid choice")."""
    import shlex

    sys.path.insert(0, str(STUDIES))
    import bert_batch
    from common import Output

    argv = ["studies/bert_batch.py", "--optimizer", "VR-LAMB first_moment", "--lr-factor", "0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    assert shlex.split(Output(tmp_path / "out", "bert_batch", {}).meta["command"]) == ["bert_batch.py", *argv[1:]]
    records = [p for p in sorted((ROOT / "docs" / "studies").glob("*/meta.json"))
               if json.loads(p.read_text())["study"] == "bert_batch"]
    assert records
    refused = []
    for path in records:
        try:
            bert_batch.parser().parse_args(shlex.split(json.loads(path.read_text())["command"])[1:])
        except SystemExit:  # argparse's error (printed to stderr)
            refused.append(path.parent.name)
    assert not refused, refused


def fake_study(directory: Path, runs: list[tuple[str, int, str, float, int, float]], **settings) -> Path:
    """A bert_batch output directory holding the given (corpus, batch, optimizer, factor, seed, loss) runs."""
    config = {"corpora": ["embedded"], "samples": 10240, "seq_len": 64, "micro_batch": 8, "ranks": 1,
              "lr_rule": "sqrt", "base_lr": 0.004, "base_batch": 64, "vocab_size": 8000, "model": "tiny", "zero": 2,
              "quick": False} | settings
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"config": config, "machine": {"commit": "abc1234", "cuda": None,
                                                                 "processor": "x86_64", "cpus": 2},
                                                     "started": "2026-11-24 06:00:00 UTC"}))
    records = [{"corpus": corpus, "batch": batch, "optimizer": label, "seed": seed, "steps": 10240 // batch,
                "lr": 0.004 * (batch / 64) ** 0.5 * factor, "factor": factor, "groups": batch // 8, "ranks": 1,
                "samples": 10240, "mlm_loss": loss, "mlm_acc": 0.05, "b_simple": None, "wall_s": 1.0, "run_dir": "gone"}
               for corpus, batch, label, factor, seed, loss in runs]
    (directory / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_reuse_refuses_a_record_made_with_other_optimizer_parameters_or_fixed_settings(tmp_path, capsys):
    """A record's recipe (the optimizers' parameters and the job's fixed settings, which no
    recorded setting names) must be this study's for the labels both know: another ``beta3`` for
    VR-LAMB, or another fixed job setting, is an error naming it; another label's parameters
    (one this study does not run) are not. A record written before recipes were recorded is
    taken as this code's, and that is said. Fails on the old code, which reused the runs of
    either kind with the study's settings alone."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import OPTIMIZERS, RUN_SETTINGS, carried_recipe, load_reused, recipe

    labels = ["LAMB", "VR-LAMB update"]
    ours = recipe({label: OPTIMIZERS[label] for label in labels})
    recorded = json.loads((fake_study(tmp_path / "ours", []) / "meta.json").read_text())["config"]
    config = {key: recorded.get(key) for key in RUN_SETTINGS} | {"corpora": recorded["corpora"], "recipe": ours}
    runs = [("embedded", 64, "VR-LAMB update", 1.0, 1, 6.5)]

    def record(name: str, theirs: dict | None) -> Path:
        return fake_study(tmp_path / name, runs, **({} if theirs is None else {"recipe": theirs}))

    assert len(load_reused([record("same", ours)], config)[0]) == 1
    other = recipe({"VR-LAMB update": dict(OPTIMIZERS["VR-LAMB update"], beta3=0.99), "MERIT": {"type": "X"}})
    with pytest.raises(SystemExit, match=r"its runs were made with other parameters for VR-LAMB update than"):
        load_reused([record("beta3", {**ours, "optimizers": other["optimizers"]})], config)
    with pytest.raises(SystemExit, match=r"its runs were made with other fixed job settings \(base_config\) than"):
        load_reused([record("job", {**ours, "job": "0" * 12})], config)
    elsewhere = {**ours, "optimizers": {**ours["optimizers"], "MERIT": other["optimizers"]["MERIT"]}}
    assert len(load_reused([record("merit", elsewhere)], config)[0]) == 1  # a label this study does not run
    capsys.readouterr()
    assert len(load_reused([record("legacy", None)], config)[0]) == 1
    assert "recorded before the recipe was" in capsys.readouterr().out
    # --out among --reuse carries over the runs of labels this study does not run: the record
    # written keeps their digests (the one it came from had none: "unrecorded", taken as before,
    # said), so a later study that runs them still checks them. Fails on the code before, whose
    # record kept only this study's labels and reused another MERIT's runs without a word
    carried = [{"optimizer": "MERIT"}]
    kept = carried_recipe(ours, carried, record("carried", elsewhere))
    assert kept["optimizers"] == {**ours["optimizers"], "MERIT": other["optimizers"]["MERIT"]}
    merit = {**config, "recipe": recipe({"MERIT": OPTIMIZERS["MERIT"]})}
    with pytest.raises(SystemExit, match=r"other parameters for MERIT"):
        load_reused([record("carried_again", kept)], merit)
    # a label this study does not run, made with other parameters than this code's, may still be its
    # noise-scale probe (probe_label looks beyond --optimizer): its runs are left out, and that is said.
    # Fails on the code before, which reused them and took their B_simple for the grid's batches
    probe = [("embedded", 64, "VR-LAMB first_moment", 1.0, seed, 6.4) for seed in (1, 2)]
    beta = recipe({"VR-LAMB first_moment": dict(OPTIMIZERS["VR-LAMB first_moment"], beta3=0.5)})["optimizers"]
    capsys.readouterr()
    reused = load_reused([fake_study(tmp_path / "probe", runs + probe, recipe={
        **ours, "optimizers": {**ours["optimizers"], **beta}})], config)[0]
    assert [key[2] for key in reused] == ["VR-LAMB update"]
    assert "2 run(s) of VR-LAMB first_moment, which this study does not run, were made with other parameters" \
        in capsys.readouterr().out
    current = {**ours, "optimizers": {**ours["optimizers"], **recipe({"VR-LAMB first_moment": OPTIMIZERS[
        "VR-LAMB first_moment"]})["optimizers"]}}
    assert len(load_reused([fake_study(tmp_path / "probe_now", runs + probe, recipe=current)], config)[0]) == 3
    unrecorded = carried_recipe(ours, carried, record("legacy_out", None))
    assert unrecorded["optimizers"]["MERIT"] == "unrecorded"
    capsys.readouterr()
    assert len(load_reused([record("unrecorded", unrecorded)], merit)[0]) == 1
    assert "its runs of MERIT were recorded before the recipe was" in capsys.readouterr().out


#: assembles a ``probe_grid`` record: the noise probe at the base batch, multiple 1 landing on it
PROBE_GRID = ("--only-finished", "--corpus", "embedded", "--optimizer", "LAMB", "--optimizer", "VR-LAMB first_moment",
              "--noise-multiple", "1", "--noise-scale", "auto", "--lr-factor", "0.5", "--lr-factor", "1",
              "--lr-factor", "2")


def probe_grid(directory: Path) -> tuple[Path, list[tuple], list[dict]]:
    """A record of LAMB and VR-LAMB first_moment at batch 64, ×0.5-×2, 2 seeds, whose VR runs
    measured ``B_simple`` near the base batch (so ``--noise-multiple 1`` lands on it): the record,
    its runs as ``fake_study`` takes them, and its run records (written back by the caller)."""
    runs = [("embedded", 64, label, f, s, 6.5 + abs(f - 1) / 10 + s / 100)
            for label in ("LAMB", "VR-LAMB first_moment") for f in (0.5, 1.0, 2.0) for s in (1, 2)]
    rec = fake_study(directory, runs)
    records = [json.loads(line) for line in (rec / "runs.jsonl").read_text().splitlines()]
    for r in records:
        r["b_simple"] = 60.0 + r["seed"] if r["optimizer"] != "LAMB" else None
    return rec, runs, records


@pytest.mark.exhaustive
def test_a_probe_run_that_is_also_a_grid_cell_is_recorded_once(tmp_path):
    """``--noise-scale auto`` with a multiple landing on ``--base-batch``: the probe runs at
    (base batch, ×1) are grid cells too. They were written to ``runs.jsonl`` twice, listed twice
    in the trajectory table and counted twice in ``run_wall_s``. Fails on the old code."""
    rec, runs, records = probe_grid(tmp_path / "rec")
    (rec / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_study("bert_batch.py", *PROBE_GRID, "--work", str(tmp_path / "work"), "--reuse", str(rec),
              "--out", str(tmp_path / "out"))
    out = [json.loads(line) for line in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    assert len(out) == len(runs) == len({(r["batch"], r["optimizer"], r["factor"], r["seed"]) for r in out})
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["run_wall_s"] == len(runs) * 1.0


@pytest.mark.exhaustive
def test_the_trajectory_table_lists_the_runs_in_the_grids_order(tmp_path):
    """A study's tables are a function of its runs: the trajectory table lists them in the grid's
    order (corpus, batch, optimizer as given, factor, seed), however they were found. It listed
    them as they came: the noise probe's runs first, and a resumed study's new runs after every
    run it found, so a record grown that way, assembled again from its runs with ``--reuse`` and
    ``--only-finished`` (the grid's order), gave other tables than its own. Fails on the old code
    (the probe's VR-LAMB runs came before LAMB's)."""
    rec, _, records = probe_grid(tmp_path / "rec")
    for r in records:
        r["trajectory"] = [{"samples": n, "mlm_loss": r["mlm_loss"] + 1 / n, "b_simple": r["b_simple"]}
                           for n in (2560, 5120, 7680, 10240)]
    tables = []
    for order in (records, records[::-1]):
        (rec / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
        out = tmp_path / f"out{len(tables)}"
        run_study("bert_batch.py", *PROBE_GRID, "--work", str(tmp_path / "work"), "--reuse", str(rec),
                  "--out", str(out))
        tables.append((out / "tables.md").read_text())
    assert tables[0] == tables[1]
    trajectory = tables[0].split("as training goes")[1].split("####")[0]
    rows = [line.split(" | ")[2:5] for line in trajectory.splitlines() if line.startswith("| embedded")]
    assert rows == [[label, f"×{f:g}", str(s)] for label in ("LAMB", "VR-LAMB first_moment")
                    for f in (0.5, 1.0, 2.0) for s in (1, 2)]


@pytest.mark.exhaustive
def test_bert_batch_assembles_committed_runs_of_several_studies(tmp_path):
    """``--reuse`` reads runs from committed outputs (two grids of one cell here) and
    ``--only-finished`` assembles them without running anything: the best factor is chosen among
    those with every seed (x8 has one seed and the lowest loss, and is not chosen), cells never
    run are '–', and the record names where the runs came from."""
    a = fake_study(tmp_path / "a", [("embedded", 64, "LAMB", f, s, 7.0 - 0.1 * f + 0.01 * s)
                                    for f in (1.0, 2.0) for s in (1, 2)])
    b = fake_study(tmp_path / "b", [("embedded", 64, "LAMB", 2.0, 1, 6.81), ("embedded", 64, "LAMB", 4.0, 1, 6.75),
                                    ("embedded", 64, "LAMB", 4.0, 2, 6.65), ("embedded", 64, "LAMB", 8.0, 1, 5.0)])
    args = ["--only-finished", "--corpus", "embedded", "--batch", "64", "--optimizer", "LAMB", "--optimizer",
            "VR-LAMB update", "--work", str(tmp_path / "work"), "--reuse", str(a), "--reuse", str(b)]
    factors = [arg for f in ("1", "2", "4", "8", "16") for arg in ("--lr-factor", f)]
    run_study("bert_batch.py", *args, *factors, "--out", str(tmp_path / "out"))
    tables = (tmp_path / "out" / "tables.md").read_text()
    assert "| embedded | 64 | 160 | 10240 | 8 | LAMB | 0.016 (×4) | ×1–×8 (4) | 6.7000 (6.6500–6.7500) |" in tables
    assert "| embedded | 64 | LAMB | 6.915 (6.910–6.920) | 6.815 (6.810–6.820) | 6.700 (6.650–6.750) | 5.000 | – |" \
        in tables
    assert "VR-LAMB update |" not in tables  # never run: no row
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [(r["dir"], r["machine"]) for r in meta["reused"]] == [(".../a", "x86_64, 2 CPU cores"),
                                                                  (".../b", "x86_64, 2 CPU cores")]
    assert not (tmp_path / "work" / "runs").exists()

    other = fake_study(tmp_path / "c", [("embedded", 64, "LAMB", 2.0, 1, 6.9)], seq_len=128)
    proc = subprocess.run([sys.executable, str(STUDIES / "bert_batch.py"), *args, "--reuse", str(other), *factors,
                           "--out", str(tmp_path / "out2")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and f"--reuse {other}: its runs used seq_len=128" in proc.stderr
    clash = fake_study(tmp_path / "d", [("embedded", 64, "LAMB", 2.0, 1, 6.5)])
    proc = subprocess.run([sys.executable, str(STUDIES / "bert_batch.py"), *args, "--reuse", str(clash), *factors,
                           "--out", str(tmp_path / "out3")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "is recorded with loss 6.81" in proc.stderr


@pytest.mark.exhaustive
def test_a_file_corpus_found_elsewhere_is_reused_when_its_runs_carry_their_data_fingerprint(tmp_path):
    """A study grown on two machines finds WikiText-2 at two paths: ``--reuse`` accepts the other
    path when every run of that corpus recorded its data fingerprint (which then decides), and
    still refuses it for runs recorded without one (before, any other path was refused)."""
    runs = [("wikitext", 64, "LAMB", 1.0, s, 6.0 + s / 100) for s in (1, 2)]
    bare = fake_study(tmp_path / "bare", runs, corpora=["wikitext=/elsewhere/wikitext-2"])
    printed = fake_study(tmp_path / "printed", runs, corpora=["wikitext=/elsewhere/wikitext-2"])
    lines = (printed / "runs.jsonl").read_text().splitlines()
    (printed / "runs.jsonl").write_text("".join(json.dumps(json.loads(line) | {"data": "0123456789abcdef"}) + "\n"
                                                for line in lines))
    args = ["--only-finished", "--corpus", f"wikitext={tmp_path / 'here'}", "--batch", "64", "--optimizer", "LAMB",
            "--lr-factor", "1", "--work", str(tmp_path / "work")]
    proc = subprocess.run([sys.executable, str(STUDIES / "bert_batch.py"), *args, "--reuse", str(bare), "--out",
                           str(tmp_path / "out1")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "corpus 'wikitext' was '/elsewhere/wikitext-2' there" in proc.stderr
    run_study("bert_batch.py", *args, "--reuse", str(printed), "--out", str(tmp_path / "out2"))
    assert "| wikitext | 64 | 160 | 10240 | 8 | LAMB | 0.004 (×1) | ×1–×1 (1) | 6.0150 (6.0100–6.0200) |" in (
        tmp_path / "out2" / "tables.md").read_text()


@pytest.mark.exhaustive
def test_bert_batch_uses_no_recorded_run_shorter_than_min_steps(tmp_path):
    """A run gets max(samples, min_steps x batch) samples: the 10-step runs at batch 1,024 that a
    study recorded at 10,240 samples before --min-steps are not this study's cells (the default
    asks 50 steps) and are left out, said on the console and in meta.json; with --min-steps 10
    they are the cells; batch 64's 160 steps count either way."""
    old = fake_study(tmp_path / "old", [("embedded", b, "LAMB", 1.0, s, 7.0 + 0.01 * s) for b in (64, 1024)
                                        for s in (1, 2)])
    args = ["--only-finished", "--corpus", "embedded", "--batch", "64", "--batch", "1024", "--optimizer", "LAMB",
            "--lr-factor", "1", "--work", str(tmp_path / "work"), "--reuse", str(old)]
    proc = subprocess.run([sys.executable, str(STUDIES / "bert_batch.py"), *args, "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "--reuse: 2 recorded run(s) took another number of steps than this study gives their batch" in proc.stdout
    tables = (tmp_path / "out" / "tables.md").read_text()
    assert "| embedded | 64 | 160 | 10240 | 8 | LAMB |" in tables
    assert "| embedded | 1024 |" not in tables.split("Held-out MLM loss at every")[0]
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["not_reused_other_steps"] == 2
    run_study("bert_batch.py", *args, "--min-steps", "10", "--out", str(tmp_path / "out10"))
    assert "| embedded | 1024 | 10 | 10240 | 128 | LAMB |" in (tmp_path / "out10" / "tables.md").read_text()


@pytest.mark.slow
@pytest.mark.exhaustive  # an end-to-end smoke run of the study script (1 min): make test-all
def test_adaptive_batch_quick(tmp_path, study_work):
    """Fixed and adaptive LAMB / VR-LAMB through the real job (1 CPU rank, 512 samples each):
    every run consumes the same samples; the adaptive ones change their batch."""
    run_study("adaptive_batch.py", "--quick", "--work", str(study_work), "--out", str(tmp_path / "out"),
              timeout=900)
    sys.path.insert(0, str(STUDIES))
    from adaptive_batch import changes

    runs = check_output(tmp_path / "out", ["batch_trajectory.png"])
    assert [r["optimizer"] for r in runs] == ["LAMB fixed", "VR-LAMB fixed", "LAMB adaptive", "VR-LAMB adaptive"]
    for r in runs:
        assert sum(r["batches"]) == 512 and math.isfinite(r["mlm_loss"])
        assert (changes(r["batches"]) > 0) == r["optimizer"].endswith("adaptive")
        assert (r["controller_ms"] is not None) == r["optimizer"].endswith("adaptive")
    # a second seed grows the committed record: its runs are read back, not run again
    run_study("adaptive_batch.py", "--quick", "--reuse", str(tmp_path / "out"), "--work", str(tmp_path / "elsewhere"),
              "--out", str(tmp_path / "again"))
    again = check_output(tmp_path / "again", ["batch_trajectory.png"])
    assert [(r["mlm_loss"], r["batches"]) for r in again] == [(r["mlm_loss"], r["batches"]) for r in runs]
    assert not (tmp_path / "elsewhere" / "quick" / "runs").exists()
    # the record named as --out among --reuse (the documented way to add a seed): its runs this
    # call does not ask for (seed 2's here) stay in it. Fails on the old code, which rewrote the
    # record with this call's runs only: 8 runs became 4
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / "meta.json").write_text((tmp_path / "out" / "meta.json").read_text())
    (grown / "runs.jsonl").write_text("".join(json.dumps({**r, "seed": seed}) + "\n" for seed in (1, 2) for r in runs))
    proc = run_study("adaptive_batch.py", "--quick", "--reuse", str(grown), "--work", str(tmp_path / "elsewhere"),
                     "--out", str(grown))
    assert "--out is among --reuse: 4 run(s) of its record this study does not use are kept in it" in proc.stdout
    kept = [json.loads(line) for line in (grown / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["seed"], r["optimizer"]) for r in kept) == sorted((s, r["optimizer"]) for s in (1, 2) for r in runs)
    # runs that read other data (another fingerprint) run again. Before, adaptive_batch.py never
    # compared the fingerprints: a record of another corpus of the same name was reused (fails on
    # the old code)
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "meta.json").write_text((tmp_path / "out" / "meta.json").read_text())
    (forged / "runs.jsonl").write_text("".join(json.dumps({**r, "data": "0123456789abcdef"}) + "\n" for r in runs))
    proc = run_study("adaptive_batch.py", "--quick", "--reuse", str(forged), "--work", str(tmp_path / "third"),
                     "--out", str(tmp_path / "third_out"), timeout=900)
    assert "4 recorded run(s) of corpus 'embedded' read other data" in proc.stdout
    assert (tmp_path / "third" / "quick" / "runs").is_dir()
    assert all("reused_from" not in r for r in check_output(tmp_path / "third_out", ["batch_trajectory.png"]))


@pytest.mark.exhaustive  # four runs that fail at their config check (about 40 s): make test-all
def test_adaptive_batch_with_failed_runs_records_them_and_exits_1(tmp_path):
    """Runs that fail (here a micro-batch the batch does not divide into: every run's job refuses
    its config) are named with their logs' ends, in meta.json too, and the study exits 1 after
    assembling what finished. Fails on the old code, which raised a TypeError on the first failed
    run's missing result and wrote no meta.json."""
    proc = subprocess.run([sys.executable, str(STUDIES / "adaptive_batch.py"), "--quick", "--micro-batch", "7",
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1 and "4 run(s) failed, the first " in proc.stderr, proc.stderr[-3000:]
    assert "TypeError" not in proc.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert len(meta["failed"]) == 4 and all(f["returncode"] == 2 for f in meta["failed"]), meta["failed"]


def test_adaptive_batch_reuses_only_a_record_with_its_settings(tmp_path):
    """``adaptive_batch.py --reuse`` refuses a record whose runs used another controller setting,
    naming the setting, before it prepares or runs anything."""
    other = tmp_path / "other"
    other.mkdir()
    config = {"quick": False, "corpus": None, "seed": None, "batch": 64, "lr": 0.004, "samples": 10240,
              "target_ratio": 4.0, "min_batch": 16, "max_batch": 1024, "every": 10, "lr_rule": "sqrt", "seq_len": 64,
              "micro_batch": 8, "ranks": 1, "workers": 1, "vocab_size": 8000, "corpora": ["embedded"]}
    (other / "meta.json").write_text(json.dumps({"config": config, "machine": {}, "started": "2026-11-24"}))
    (other / "runs.jsonl").write_text("")
    proc = subprocess.run([sys.executable, str(STUDIES / "adaptive_batch.py"), "--reuse", str(other),
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and f"--reuse {other}: its runs used target_ratio=4.0, this study 2.0" in proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_results_page_is_generated_from_the_committed_outputs():
    if not (ROOT / "docs" / "results.template.md").exists():
        pytest.fail("docs/results.template.md is missing")
    proc = subprocess.run([sys.executable, str(STUDIES / "page.py"), "--check"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_reused_records_directory_is_kept_as_a_committed_record_keeps_paths(tmp_path):
    """Runs read with ``--reuse`` from a scratch directory carried its absolute path into the
    assembled record (``reused_from`` of each run, ``reused[].dir`` in meta.json: the plateau
    record named /tmp/...). ``load_reused`` now keeps it as ``portable`` does the command: relative
    inside the checkout, else ``.../`` and its last part. Fails on the old code."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import RUN_SETTINGS, load_reused

    rec = fake_study(tmp_path / "scratch_out", [("embedded", 64, "LAMB", 1.0, 1, 7.0),
                                                ("embedded", 256, "LAMB", 1.0, 1, 7.1)])
    config = json.loads((rec / "meta.json").read_text())["config"] | {"min_steps": 50}
    runs, sources, shorter = load_reused([rec], config, tuple(k for k in RUN_SETTINGS if k in config))
    assert [r["reused_from"] for r in runs.values()] == [".../scratch_out"]  # 160 steps at 64
    assert [r["reused_from"] for r in shorter] == [".../scratch_out"]  # 40 steps at 256, 50 asked: another budget
    assert [src["dir"] for src in sources] == [".../scratch_out"]
    committed = ROOT / "docs" / "studies" / "bert_plateau"
    assert load_reused([committed], json.loads((committed / "meta.json").read_text())["config"])[1][0]["dir"] == (
        "docs/studies/bert_plateau")


def test_a_record_assembled_from_records_keeps_where_each_run_was_made(tmp_path):
    """A record assembled from records (a GPU lease's output reused into the committed record, and
    that record reused again to assemble it anew) kept, for each run, only the last directory it
    was read from and that assembly's Python: the 4 H200 runs of the plateau record lost their
    Python 3.12.3 and their lease's directory on reassembly. For the embedded corpus, whose
    documents are the Python release's, ``set_aside_other_data`` decides by that release, so the
    run then counted as made on the assembling machine's. Now a run's own ``reused_from`` and
    ``reused_python`` stay. Fails on the old code."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import RUN_SETTINGS, load_reused

    lease = fake_study(tmp_path / "lease", [("embedded", 64, "LAMB", 1.0, 1, 7.0)])
    meta = json.loads((lease / "meta.json").read_text())
    meta["machine"]["python"] = "3.12.3"
    (lease / "meta.json").write_text(json.dumps(meta))
    config = meta["config"] | {"min_steps": None}
    settings = tuple(k for k in RUN_SETTINGS if k in config)
    runs, _, _ = load_reused([lease], config, settings)
    committed = fake_study(tmp_path / "committed", [("embedded", 64, "LAMB", 2.0, 1, 6.9)])  # assembled on 3.11.7
    meta = json.loads((committed / "meta.json").read_text())
    meta["machine"]["python"] = "3.11.7"
    (committed / "meta.json").write_text(json.dumps(meta))
    with (committed / "runs.jsonl").open("a") as f:  # the lease's run, as the assembly wrote it
        f.write(json.dumps(runs["embedded", 64, "LAMB", 1.0, 1]) + "\n")
    again, _, _ = load_reused([committed], config, settings)
    assert (again["embedded", 64, "LAMB", 1.0, 1]["reused_from"],
            again["embedded", 64, "LAMB", 1.0, 1]["reused_python"]) == (".../lease", "3.12.3")
    assert (again["embedded", 64, "LAMB", 2.0, 1]["reused_from"],
            again["embedded", 64, "LAMB", 2.0, 1]["reused_python"]) == (".../committed", "3.11.7")


def test_a_study_of_some_optimizers_reuses_the_recorded_noise_scale_probe():
    """The plateau record measured ``B_simple`` with VR-LAMB ``first_moment`` at batch 64. Run
    again with ``--optimizer "VR-LAMB update"`` alone (the 1× cells left), the old code took the
    first VR optimizer among ``--optimizer`` as the probe and started 1,600-step runs of
    ``update`` at batch 64 before any cell. The probe is now one whose runs are recorded, else the
    first VR optimizer asked for."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import probe_label

    def runs(label, seeds=(1, 2)):
        return {("wikitext", 64, label, 1.0, s): {} for s in seeds}

    recorded = runs("VR-LAMB first_moment") | runs("LAMB")
    assert probe_label(["VR-LAMB update"], recorded, "wikitext", 64, [1, 2]) == "VR-LAMB first_moment"
    assert probe_label(["LAMB", "VR-LAMB update"], {}, "wikitext", 64, [1, 2]) == "VR-LAMB update"
    assert probe_label(["VR-LAMB update", "VR-LAMB first_moment"], recorded | runs("VR-LAMB update"), "wikitext", 64,
                       [1, 2]) == "VR-LAMB update"  # among those asked for first
    one_seed = runs("VR-LAMB first_moment", (1,))
    assert probe_label(["VR-LAMB update"], one_seed, "wikitext", 64, [1, 2]) == "VR-LAMB update"
    assert probe_label(["LAMB"], recorded, "embedded", 64, [1, 2]) is None


def test_a_finished_run_in_the_work_directory_is_read_back_only_with_the_studys_settings(tmp_path):
    """A run finished in ``--work`` was read back by its directory alone, whose name holds neither
    the LR rule, the model, the held-out share nor the evaluation points: a study at other settings
    took it as its own cell. Now its ``study_config.json`` must match (where the data lies and how
    it is read aside), else the study stops naming what differs. Fails on the old code."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    import bert_batch

    def args(**kw):
        return argparse.Namespace(**dict(
            work=tmp_path / "work", samples=10240, min_steps=50, seq_len=64, micro_batch=8, ranks=1, workers=1,
            model="tiny", base_lr=4e-3, base_batch=64, lr_rule="sqrt", groups=None, dropout=None,
            heldout_fraction=None, eval_points=None, only_finished=False, reused={}) | kw)

    launch = bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args())
    launch.run_dir.mkdir(parents=True)
    (launch.run_dir / "study_config.json").write_text(json.dumps(launch.config))
    (launch.run_dir / "result.json").write_text(json.dumps(launch.record | {"mlm_loss": 6.9}))
    # the same run, its data read from elsewhere by more workers: read back
    again = bert_batch.plan_run("LAMB", "embedded", tmp_path / "moved", 64, 1.0, 1, args(workers=4))
    assert again["mlm_loss"] == 6.9
    with pytest.raises(SystemExit, match=r"job\.model\.size: 'tiny' there, 'mini' here"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args(model="mini"))
    with pytest.raises(SystemExit, match=r"job\.phases\.0\.lr: 0\.004 there, 0\.008 here"):  # another LR
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args(base_lr=8e-3))
    with pytest.raises(SystemExit, match=r"job\.data\.heldout_fraction: None there, 0\.1 here"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args(heldout_fraction=0.1))
    # finished before runs kept their config: its result's steps and LR must be this study's. At
    # twice the samples its directory is still seed1 (samples // batch steps are not named).
    # Fails on the code before, which read the 160-step run back into a 320-step cell
    (launch.run_dir / "study_config.json").unlink()
    with pytest.raises(SystemExit, match=r"a finished run of 160 steps at LR 0\.004, this study's 320 at 0\.004"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args(samples=20480))
    with pytest.raises(SystemExit, match=r"a finished run of 160 steps at LR 0\.004, this study's 160 at 0\.008"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args(base_lr=8e-3))
    assert bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args())["mlm_loss"] == 6.9


def test_a_run_in_the_work_directory_is_read_back_or_resumed_only_on_its_data(tmp_path, monkeypatch):
    """``prepare`` writes another vocabulary size or source of a corpus name into the same
    ``<work>/data/<name>``, and ``same_settings`` leaves the data's path aside: a finished run of
    the old data was read back as this study's, and a paused one resumed into a job that refused
    its checkpoint (``checkpoint.data_change``) at every start. Now the recorded fingerprint (the
    result's, the paused checkpoint's marker's) must be the data's now, else the study stops
    naming both. Fails on the old code, which read the finished run back."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    import bert_batch

    from vrgd_ds.train import checkpoints as ckpt

    args = argparse.Namespace(
        work=tmp_path / "work", samples=10240, min_steps=50, seq_len=64, micro_batch=8, ranks=1, workers=1,
        model="tiny", base_lr=4e-3, base_batch=64, lr_rule="sqrt", groups=None, dropout=None,
        heldout_fraction=None, eval_points=None, only_finished=False, reused={})
    now = {"fp": "00aa"}
    monkeypatch.setattr(bert_batch, "data_fingerprint", lambda data, seed, heldout=None: now["fp"])
    launch = bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args)
    launch.run_dir.mkdir(parents=True)
    (launch.run_dir / "study_config.json").write_text(json.dumps(launch.config))
    (launch.run_dir / "result.json").write_text(json.dumps(launch.record | {"mlm_loss": 6.9, "data": "00aa"}))
    assert bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args)["mlm_loss"] == 6.9
    now["fp"] = "11bb"  # another vocabulary prepared there since
    with pytest.raises(SystemExit, match=r"a finished run of other data than this study's \(fingerprint 00aa there, "
                                         r"11bb in"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args)
    (launch.run_dir / "result.json").unlink()  # paused at step 4 instead, its checkpoint of the old data
    (launch.run_dir / bert_batch.PAUSED).write_text(json.dumps([{"wall_s": 1.0, "step": 4, "samples": 256}]))
    (launch.run_dir / "checkpoints" / "step00000004").mkdir(parents=True)
    (launch.run_dir / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    ckpt.mark_complete(launch.run_dir / "checkpoints", "step00000004", 4, 1, {"data": "00aa"})
    with pytest.raises(SystemExit, match=r"a paused run of other data than this study's \(fingerprint 00aa there"):
        bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args)
    now["fp"] = "00aa"
    assert isinstance(bert_batch.plan_run("LAMB", "embedded", tmp_path / "data", 64, 1.0, 1, args), bert_batch.Launch)


def test_a_study_that_ends_early_leaves_its_out_directorys_record_whole(tmp_path):
    """With ``--out`` one of the ``--reuse`` records, ``Output`` deleted its ``runs.jsonl`` at once
    and the runs not used again were written back at the very end: a study ending before (an
    error, SIGTERM) left the committed record with the runs logged so far, or none, beside its
    old tables. The runs now go to a file of their own until ``finish`` puts it in place. Fails on
    the old code."""
    sys.path.insert(0, str(STUDIES))
    from common import Output

    record = tmp_path / "record"
    record.mkdir()
    (record / "runs.jsonl").write_text('{"run": 1}\n{"run": 2}\n')
    out = Output(record, "bert_batch", {})
    out.log_run({"run": 3})
    assert (record / "runs.jsonl").read_text() == '{"run": 1}\n{"run": 2}\n'  # ended here: the record whole
    out.finish()
    assert (record / "runs.jsonl").read_text() == '{"run": 3}\n'
    assert not any(p.name.endswith(".partial") for p in record.iterdir())


def test_the_page_counts_a_records_runs_by_the_machine_each_ran_on(tmp_path):
    """The plateau record's 4 runs from an H200 lease, reused into it, were named nowhere on the
    page, whose opening said no row came from a GPU: the record line named only the directories
    read directly. It now counts the runs of ``runs.jsonl`` by their own ``machine``. Fails on the
    old code (the committed page). The expected counts are read from the record's own runs, so
    that runs joining it do not fail the test while the page follows them."""
    sys.path.insert(0, str(STUDIES))
    from page import run_machines

    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(json.dumps({"machine": m}) for m in ("cpu", "gpu", "cpu", None)) + "\n")
    assert run_machines(runs) == " Its runs by machine: 2 on cpu; 1 on gpu."
    assert run_machines(tmp_path / "absent.jsonl") == ""
    page = (ROOT / "docs" / "results.md").read_text()
    line = run_machines(ROOT / "docs" / "studies" / "bert_plateau_steps128" / "runs.jsonl")
    assert "on NVIDIA H200" in line and line in page  # the counts follow the record as runs join it
    assert "no row came from a GPU" not in page


def test_the_page_refuses_a_template_that_repeats_a_section():
    """An edit pasted sections 2 and 3 of docs/results.template.md a second time, with the
    seed-check paragraph new in one copy and old in the other, and the page was generated from
    it. ``render`` now refuses a template whose headings or study marks repeat, naming them (on
    the old template, test_results_page_is_generated_from_the_committed_outputs fails so)."""
    sys.path.insert(0, str(STUDIES))
    from page import render

    text = "# Results\n\n## 2. Collapse\n\nprose\n\n## 3. BERT\n\n## 2. Collapse\n\nprose again\n"
    with pytest.raises(SystemExit, match="repeats ## 2. Collapse: keep one of each"):
        render(text)
    assert render(text.replace("## 2. Collapse\n\nprose again", "## 4. Other")).count("## 2. Collapse") == 1
    # a mark with a trailing space, or misspelt, stayed on the page as text, --check passing. Fails on the old code
    for bad in ("{{study:linreg}} ", "{{study:lin-reg}}"):
        with pytest.raises(SystemExit, match="line 3: .* is no study mark"):
            render(f"# Results\n\n{bad}\n")


def test_noise_scale_read_back_survives_a_step_without_one(tmp_path):
    """A step whose unbiased |G|^2 estimate is <= 0 logs ``noise_scale/b_simple: null``. The old
    ``read_metrics`` averaged the per-step ``b_simple`` values: it raised TypeError on the null
    (the adaptive-batch study crashed on it), and without the null one near-zero |G|^2 step
    dominated the mean (730 samples where the moments say 26). It now takes the ratio of the
    mean moments over the second half, in samples."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import read_metrics

    steps = [(4.0, 1.0), (4.0, 1.0), (4.0, 1.0), (4.0, 0.01), (4.0, -0.2)]  # (trace_cov, grad_sq) per group
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for i, (t, g) in enumerate(steps):
            ok = g > 0
            fh.write(json.dumps({"step": i + 1, "train/global_batch": 16.0, "gsnr/n": 2.0,
                                 "noise_scale/trace_cov": t, "noise_scale/grad_sq": g,
                                 "noise_scale/b_simple_groups": t / g if ok else None,
                                 "noise_scale/b_simple": 8 * t / g if ok else None}) + "\n")
        fh.write(json.dumps({"step": 5, "eval/mlm_loss": 7.0, "eval/mlm_acc": 0.05}) + "\n")
    last, b_simple = read_metrics(tmp_path)
    assert last["eval/mlm_loss"] == 7.0
    half = steps[2:]  # the second half: 8 samples per group x mean trace / mean |G|^2
    assert b_simple == pytest.approx(8 * 4.0 / (sum(g for _, g in half) / len(half)))


def test_noise_scale_read_back_survives_a_step_with_a_zero_trace(tmp_path):
    """A step whose trace estimate is exactly 0 logs ``b_simple`` and ``b_simple_groups`` of 0.
    The old read-back took the samples per group as their ratio and raised ZeroDivisionError
    there; it is the step's global batch over its groups ``gsnr/n``, for ``read_metrics`` and
    ``trajectory`` alike."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import read_metrics, trajectory

    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for i, t in enumerate([3.0, 3.0, 0.0, 0.0]):
            fh.write(json.dumps({"step": i + 1, "train/global_batch": 32.0, "gsnr/n": 4.0, "train/samples": 32.0 * (i + 1),
                                 "noise_scale/trace_cov": t, "noise_scale/grad_sq": 2.0,
                                 "noise_scale/b_simple_groups": t / 2.0, "noise_scale/b_simple": 8 * t / 2.0,
                                 **({"eval/mlm_loss": 7.0} if i in (1, 3) else {})}) + "\n")
    assert read_metrics(tmp_path)[1] == 0.0  # the second half: trace 0
    assert [p["b_simple"] for p in trajectory(tmp_path)] == [8 * 3.0 / 2.0, 0.0]


def test_bf16_moments_study_tells_the_exact_choice_from_the_cancelling_ones():
    """``studies/bf16_moments.py``'s comparison on gradients whose GSNR is high (a mean 50 times
    the spread): fp32 sums of the bf16 gradients (``local``) give the exact scale; DeepSpeed's
    bf16-rounded mean against fp32 squares (``engine``) cancels in ``s - ḡ²`` and moves the scale
    of most elements; a second moment shifted around the last step's mean still takes DeepSpeed's
    bf16 mean, whose rounding it meets in ``(ḡ - c)²``: not exact either."""
    sys.path.insert(0, str(STUDIES))
    import bf16_moments

    g = torch.Generator().manual_seed(0)
    mean = torch.randn(4096, generator=g)
    prev = mean + 0.01 * torch.randn(4096, generator=g)  # the last step's mean: close to this one
    grads = [[(mean + 0.02 * torch.randn(4096, generator=g)).bfloat16()] for _ in range(8)]
    res = bf16_moments.statistics(grads, [prev], ranks=2, gamma=0.1)
    assert res["local"]["max_err"] < 1e-5
    assert res["engine"]["share_over_1pct"] > 0.3
    assert res["shifted"]["share_over_1pct"] > 0.01 and res["shifted, bf16 squares"]["max_err"] > 0.1


def test_reused_runs_of_other_data_are_set_aside():
    """The H100 cells of docs/results.md differed from the CPU cells of the same seed because they
    read other data: the embedded corpus is the running interpreter's documentation (Python 3.12
    there, 3.11.7 here), so the tokenizer, the samples and the held-out set all differed (their
    evaluated-token counts differ on both seeds). A reused run is now kept only if it read this
    study's data: its recorded data fingerprint equals this study's for its seed, or, recorded
    before fingerprints, its embedded corpus came from the same Python release. Before, such runs
    were merged into the same cells as if they were the same experiment."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import set_aside_other_data

    def run(corpus, seed, **extra):
        return {"corpus": corpus, "batch": 1024, "optimizer": "LAMB", "factor": 2.0, "seed": seed, **extra}

    reused = {
        ("embedded", 1): run("embedded", 1, data="aaaa"),  # this study's data: kept
        ("embedded", 2): run("embedded", 2, data="zzzz"),  # another tokenizer/shards/split: set aside
        ("embedded", 3): run("embedded", 3, reused_python="3.12.3"),  # no fingerprint, another release: aside
        ("embedded", 4): run("embedded", 4, reused_python="3.11.7"),  # no fingerprint, same release: kept
        ("wikitext", 3): run("wikitext", 3, reused_python="3.12.3"),  # a file corpus: the release does not matter
    }
    fingerprints = {1: "aaaa", 2: "bbbb", 3: "cccc", 4: "dddd"}
    aside = set_aside_other_data(reused, "embedded", fingerprints.get, "3.11.7")
    assert sorted(r["seed"] for r in aside) == [2, 3]
    assert sorted(reused) == [("embedded", 1), ("embedded", 4), ("wikitext", 3)]
    assert set_aside_other_data(reused, "wikitext", fingerprints.get, "3.11.7") == []
    # nothing prepared here to compare a fingerprint with (--only-finished elsewhere): kept
    kept = {("embedded", 5): run("embedded", 5, data="eeee", reused_python="3.11.7")}
    assert set_aside_other_data(kept, "embedded", lambda seed: None, "3.11.7") == [] and len(kept) == 1


@pytest.mark.exhaustive  # WikiText-2 prepared end to end (10-15 s): make test-all
def test_wikitext_prepared_here_is_the_data_the_committed_records_read(shared_data, tmp_path):
    """WikiText-2 as the BERT study prepares it (vocabulary 8,000, seq 64, held-out 0.1) has the
    data fingerprints that every run of docs/studies/bert_plateau, docs/studies/bert_plateau_steps128,
    docs/studies/bert_seed_check and docs/studies/bert_seed_check_h200 (the same runs on a GPU)
    recorded, so a machine that passes this reuses those records and its seed check compares the
    same samples and masks. The H100's image has sentencepiece 0.2.2, which trains another
    tokenizer from the same files: there all 22 runs of the plateau record were set aside and the
    seed check compared other data. Under sentencepiece 0.2.2 this test fails; the pinned release
    (pyproject.toml) passes."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import data_fingerprint, prepare

    data = prepare("wikitext", str(shared_data), tmp_path, 64, 8000)
    for name in ("bert_plateau", "bert_plateau_steps128", "bert_seed_check", "bert_seed_check_h200"):
        record = ROOT / "docs" / "studies" / name
        assert json.loads((record / "meta.json").read_text())["config"]["heldout_fraction"] == 0.1
        runs = [json.loads(line) for line in (record / "runs.jsonl").read_text().splitlines()]
        recorded = {(r["seed"], r["data"]) for r in runs}
        assert recorded == {(seed, data_fingerprint(data, seed, 0.1)) for seed in (1, 2)}, name


def assembly_args(meta: dict) -> list[str]:
    """The ``bert_batch.py`` options of a record's settings (``meta.json``'s ``config``): what
    assembling it again from its runs takes, less ``--corpus``, ``--reuse``, ``--work`` and ``--out``."""
    cfg = meta["config"]
    args = ["--model", cfg["model"], "--only-finished"]
    for key, flag in (("seeds", "--seed"), ("optimizers", "--optimizer"), ("lr_factors", "--lr-factor"),
                      ("noise_multiples", "--noise-multiple")):
        args += [a for v in cfg.get(key) or [] for a in (flag, f"{v:g}" if isinstance(v, float) else str(v))]
    if not cfg.get("noise_multiples"):
        args += [a for b in cfg["batches"] for a in ("--batch", str(b))]
    for key, flag in (("noise_scale", "--noise-scale"), ("bracket", "--bracket"), ("samples", "--samples"),
                      ("min_steps", "--min-steps"), ("groups", "--groups"), ("heldout_fraction", "--heldout-fraction"),
                      ("eval_points", "--eval-points"), ("seq_len", "--seq-len"), ("vocab_size", "--vocab-size"),
                      ("base_lr", "--base-lr"), ("base_batch", "--base-batch"), ("lr_rule", "--lr-rule")):
        if cfg.get(key) is not None:
            args += [flag, f"{cfg[key]:g}" if isinstance(cfg[key], float) else str(cfg[key])]
    return args + (["--bracket-carry"] if cfg.get("bracket_carry") else [])


@pytest.mark.exhaustive  # WikiText-2 prepared (10-15 s), two records assembled: make test-all
def test_the_plateau_records_tables_are_what_their_runs_give(shared_data, tmp_path):
    """The two BERT records on the results page with verdicts, assembled again from their own
    runs (``--only-finished``, the data prepared here for the unigram levels), give their
    committed ``tables.md``: a change to how the verdicts, brackets or tables are made shows up as
    a stale record here, not only in ``page.py --check`` (which compares the page with the
    records). Fails on the records before the grid-neighbour bracket, whose 16× verdicts stood
    on a bracket with ×0.5 unrun. The section of runs stopped unfinished, which only the work
    directory's state at assembly gives, is left out of the comparison and counted against
    ``meta.json``'s ``stopped``."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import prepare

    prepare("wikitext", str(shared_data), tmp_path / "work", 64, 8000)
    for name in ("bert_plateau", "bert_plateau_steps128"):
        record = ROOT / "docs" / "studies" / name
        meta = json.loads((record / "meta.json").read_text())
        assert meta["config"]["corpora"] == ["wikitext=.data/wikitext-2"], name
        reuse = [a for r in meta["reused"] for a in ("--reuse", r["dir"])]
        run_study("bert_batch.py", *assembly_args(meta), "--corpus", f"wikitext={shared_data}", *reuse,
                  "--work", str(tmp_path / "work"), "--out", str(tmp_path / name))
        committed, stopped = _finished_part((record / "tables.md").read_text())
        assert (tmp_path / name / "tables.md").read_text() == committed, name
        assert len(stopped) == len(meta.get("stopped", [])), name


STOPPED_SECTION = "#### Runs the time limit or SIGUSR1 stopped unfinished"


def _finished_part(tables: str) -> tuple[str, list[str]]:
    """A record's ``tables.md`` less its section of runs stopped unfinished, and that section's
    rows: the section reports the work directory's state when the record was assembled (a paused
    run's step and rate), which no assembly from the finished runs gives again."""
    head, sep, rest = tables.partition(STOPPED_SECTION)
    if not sep:
        return tables, []
    section, nxt, tail = rest.partition("\n#### ")
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]  # less header, rule
    return head.rstrip("\n") + "\n\n" + nxt.lstrip("\n") + tail if nxt else head.rstrip("\n") + "\n", rows


@pytest.mark.slow
@pytest.mark.exhaustive  # two preparations of a small corpus (10-30 s): make test-all
def test_the_same_corpus_prepared_from_another_folder_into_another_has_the_same_fingerprint(tmp_path):
    """Two machines prepare WikiText-2 from their own folders into their own work directories: the
    manifests differ only in ``source`` and ``tokenizer_path``, and the data fingerprint is the
    same (the job's resume report and the studies' ``--reuse`` compare it). Fails on the code
    before: it hashed the manifest file, paths included, so a run on another machine was set aside
    as other data, and a moved data directory read as changed data."""
    from vrgd_ds.data_pipeline.prepare import SHARDS_DIR, TOKENIZER_FILE
    from vrgd_ds.data_pipeline.shards import MANIFEST
    from vrgd_ds.train.data import prepared_fingerprint

    words = ["".join("abcdefghij"[int(d)] for d in str(i * 7919 % 1009)) for i in range(600)]
    text = "".join(f" = Part {k} = \n\n" + "".join(" " + " ".join(words[(k * 31 + j * 7 + n) % 600] for n in range(12))
                                                  + " .\n" for j in range(40)) for k in range(6))
    prints = []
    for where in ("one", "two"):
        src = tmp_path / where / "corpus"
        src.mkdir(parents=True)
        (src / "valid.txt").write_text(text)
        out = tmp_path / where / "prepared"
        subprocess.run([sys.executable, "-m", "vrgd_ds.data_pipeline", "prepare", str(out), str(src / "valid.txt"),
                        "--format", "wikitext", "--vocab-size", "100", "--seq-len", "32", "--seed", "1",
                        "--no-progress"], check=True, capture_output=True, timeout=300)
        prints.append(prepared_fingerprint(out, 1, 0.1, None))
        manifest = json.loads((out / SHARDS_DIR / MANIFEST).read_text())
        assert str(tmp_path / where) in manifest["source"] + manifest["tokenizer_path"]
    assert (tmp_path / "one" / "prepared" / TOKENIZER_FILE).read_bytes() == \
        (tmp_path / "two" / "prepared" / TOKENIZER_FILE).read_bytes()
    assert prints[0] is not None and prints[0] == prints[1]


def test_a_run_records_the_fingerprint_of_the_data_it_read(tmp_path):
    """The study's fingerprint of prepared data is the job's (``vrgd_ds.train.data``): the same
    files and seed give the same value, another seed or another tokenizer another one."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import data_fingerprint

    from vrgd_ds.data_pipeline.prepare import SHARDS_DIR, TOKENIZER_FILE
    from vrgd_ds.data_pipeline.shards import MANIFEST

    assert data_fingerprint(tmp_path, 1) is None  # nothing prepared
    (tmp_path / SHARDS_DIR).mkdir()
    (tmp_path / SHARDS_DIR / MANIFEST).write_text(json.dumps({"num_documents": 100}))
    (tmp_path / TOKENIZER_FILE).write_bytes(b"pieces")
    one = data_fingerprint(tmp_path, 1)
    assert one == data_fingerprint(tmp_path, 1) and one != data_fingerprint(tmp_path, 2)
    (tmp_path / TOKENIZER_FILE).write_bytes(b"other pieces")
    assert data_fingerprint(tmp_path, 1) != one


def test_verdicts_hold_each_baseline_run_to_its_own_seeds_unigram_level():
    """Each seed has its own held-out masks and unigram level: the baseline's runs must each end
    below their own seed's. Fails on the old code, which held them to the mean of the seeds'
    levels: a verdict with seed 2 still 0.022 nats above its plateau, and none with both seeds
    below theirs."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import verdicts

    def cell(*losses):
        return [{"mlm_loss": x, "seed": seed} for seed, x in enumerate(losses, 1)]

    best = {("c", 64, "LAMB"): cell(6.30, 6.28), ("c", 64, "VR"): cell(6.05, 6.10)}
    above = verdicts(best, "c", [64], "VR", "LAMB", unigram={1: 6.3521, 2: 6.2578})
    assert above[0][-1] == "not decided: LAMB ends 0.022 nats above the unigram level"
    best = {("c", 64, "LAMB"): cell(6.33, 6.20), ("c", 64, "VR"): cell(6.05, 6.10)}
    below = verdicts(best, "c", [64], "VR", "LAMB", unigram={1: 6.3521, 2: 6.2578})
    assert below[0][-1] == "VR better by 0.190 nats (seed ranges apart)" and below[0][5] == "0.022"
    assert below[0][4] == "1: -0.280, 2: -0.100"  # seed by seed: each seed's runs read the same data


def test_verdicts_compare_the_same_seeds_and_no_seed_diverged_at_a_best_lr():
    """Each seed has its own samples and held-out masks, so the arms must hold the same seeds:
    with LAMB's best LR finished on seeds 1 and 2 and VR's on 2 and 3, the old code gave "VR
    better by 0.155 nats (seed ranges apart)" where the one shared seed differs by -0.010. And a
    best LR where one seed diverged and another did not gave "no difference beyond the seeds
    (+inf nats)". Both are "not decided" now, saying why (both fail on the old code)."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import verdicts

    def cell(**losses):
        return [{"mlm_loss": x, "seed": int(seed[1:])} for seed, x in losses.items()]

    best = {("c", 64, "LAMB"): cell(s1=6.30, s2=6.20), ("c", 64, "VR"): cell(s2=6.19, s3=6.00)}
    (row,) = verdicts(best, "c", [64], "VR", "LAMB", unigram=7.0)
    assert row[-1] == "not decided: not the same seeds (LAMB 1, 2; VR 2, 3)"
    best["c", 64, "VR"] = cell(s1=6.10, s2=math.inf)
    (row,) = verdicts(best, "c", [64], "VR", "LAMB", unigram=7.0)
    assert row[-1] == "not decided: VR diverged on seed 2 at its best LR"
    best["c", 64, "VR"] = cell(s1=math.inf, s2=math.inf)  # diverged on every seed: worse, ranges apart
    (row,) = verdicts(best, "c", [64], "VR", "LAMB", unigram=7.0)
    assert row[-1] == "VR worse by inf nats (seed ranges apart)"


def test_a_run_checkpointed_by_a_signal_from_outside_the_study_is_kept_paused(tmp_path, capsys):
    """A ``SIGUSR1`` sent to a run's ranks from outside the study (Slurm's ``--signal=USR1``, a
    ``kill`` of the process group) makes the job checkpoint and exit with ``EXIT_REQUEUE``: the
    run is paused, its segment kept beside its checkpoint for the next start, not failed. Fails on
    the code before, which recorded it failed, and the next start removed its directory, checkpoint
    and all. And a run paused on one machine and finished on another names both."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch, Runner

    from vrgd_ds.train.loop import EXIT_REQUEUE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "time": time.time(), "train/samples": 24.0}) + "\n")
    (run_dir / "requeue.json").write_text("{}")
    launch = Launch(run_dir, [], {}, {"corpus": "c", "batch": 8, "optimizer": "o", "seed": 1, "factor": 1.0,
                                      "lr": 1e-3, "steps": 10, "samples": 80}, tmp_path / "no-data")
    proc = type("Exited", (), {"returncode": EXIT_REQUEUE, "poll": lambda self: EXIT_REQUEUE})()
    log = type("Log", (), {"close": lambda self: None})()
    runner = Runner(argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=None))
    runner.machine = "cpu"
    active, results = {0: (0, proc, time.monotonic() - 30.0, log)}, [None]
    runner.collect([launch], active, results, None)
    assert not active and results == [None] and runner.failed == []
    assert [(g["machine"], g["step"], g["samples"]) for g in launch.segments()] == [("cpu", 3, 24.0)]
    assert (run_dir / PAUSED).is_file() and [g["paused"] for g in runner.stopped] == [True]
    assert "run paused by a signal from outside the study at step 3 of 10" in capsys.readouterr().out
    assert launch.result(wall_s=5.0, machine="gpu", diverged=True)["machine"] == "cpu + gpu"


def test_verdicts_need_two_seeds_below_the_unigram_level_and_apart_ranges():
    """``verdicts`` in-process (the end-to-end study below is in the exhaustive tier): a cell
    with one seed, LAMB at or above the unigram level, overlapping and separate seed ranges, the
    degradation row, and a best LR at the edge of the factors run (not bracketed: no verdict).
    Without a unigram level (no data prepared where the record was assembled) the old code gave
    verdicts without checking the baseline got past the plateau; now it gives none."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import best_cells, by_factor, unrun_cells, verdicts

    def cell(*losses):
        return [{"mlm_loss": x} for x in losses]

    best = {("c", 16, "LAMB"): cell(6.50, 6.60), ("c", 16, "VR"): cell(6.55, 6.58),
            ("c", 64, "LAMB"): cell(6.90, 6.95), ("c", 64, "VR"): cell(6.70, 6.75),
            ("c", 256, "LAMB"): cell(7.10, 7.20), ("c", 256, "VR"): cell(7.00)}
    assert [r[-1] for r in verdicts(best, "c", [16, 64], "VR", "LAMB", unigram=None)][:2] == [
        "not decided: the unigram level is not computed (no prepared data)"] * 2  # gave a verdict: fails on the old code
    rows = verdicts(best, "c", [16, 64, 256], "VR", "LAMB", unigram=7.0)
    # on one seed at the last batch: no degradation share, and the row says why. Fails on the old
    # code, which left the row out
    assert [r[-1] for r in rows] == ["no difference beyond the seeds (+0.015 nats)",
                                     "VR better by 0.200 nats (seed ranges apart)",
                                     "not decided: VR lacks 2 seeds",
                                     "not decided: batch 256: VR lacks 2 seeds"]
    assert rows[2][2] == "7.150 (7.100–7.200)"  # the arm with 2 seeds is shown
    assert rows[0][5] == "0.400" and rows[1][5] == "0.050"  # LAMB's margin below the unigram level
    assert rows[0][4] == "–"  # runs without seeds: none to pair
    best["c", 256, "VR"] = cell(7.00, 7.04)
    rows = verdicts(best, "c", [16, 64, 256], "VR", "LAMB", unigram=7.3)
    assert rows[2][-1] == "VR better by 0.130 nats (seed ranges apart)"
    assert rows[3][2:] == ("LAMB loses +0.600", "VR recovers +0.130", "", "", "recovered share 22%")
    # an end batch not decided (here LAMB above the unigram level at 256): no share, and the end
    # row's reason. Fails on the old code, which gave "recovered share 22%" whatever the end
    # batches' verdicts, and on the code after it, which said "batch 256 not decided" without why
    rows = verdicts(best, "c", [16, 64, 256], "VR", "LAMB", unigram=7.15)
    assert rows[2][-1] == "not decided: LAMB ends 0.050 nats above the unigram level"
    assert rows[3][-1] == "not decided: batch 256: LAMB ends 0.050 nats above the unigram level"
    above = verdicts({k: v for k, v in best.items() if k[1] == 64}, "c", [64], "VR", "LAMB", unigram=6.92)
    assert above[0][-1] == "not decided: LAMB ends 0.030 nats above the unigram level"
    # the best LR must be bracketed by its neighbours on the grid, run on its seeds: else no verdict
    grid = [0.5, 1.0, 2.0, 4.0, 8.0]
    runs = [{"corpus": "c", "batch": 64, "optimizer": name, "factor": f, "seed": seed, "mlm_loss": loss + 0.01 * seed}
            for name, losses in (("LAMB", {1.0: 6.9, 2.0: 6.8, 4.0: 6.95}), ("VR", {1.0: 6.9, 2.0: 6.8, 4.0: 6.7}))
            for f, loss in losses.items() for seed in (1, 2)]
    runs.append({"corpus": "c", "batch": 64, "optimizer": "VR", "factor": 8.0, "seed": 1, "mlm_loss": 6.9})
    rows = verdicts(best_cells(runs), "c", [64], "VR", "LAMB", unigram=7.0, cells=by_factor(runs), grid=grid)
    assert rows[0][-1] == "not decided: VR's best LR ×4 has ×8 beside it on the grid not run on 2 seeds"
    runs.append({"corpus": "c", "batch": 64, "optimizer": "VR", "factor": 8.0, "seed": 2, "mlm_loss": 6.9})
    rows = verdicts(best_cells(runs), "c", [64], "VR", "LAMB", unigram=7.0, cells=by_factor(runs), grid=grid)
    assert rows[0][-1] == "VR better by 0.100 nats (seed ranges apart)"
    # the grid as --lr-factor was typed, out of order and repeated: the same verdict
    rows = verdicts(best_cells(runs), "c", [64], "VR", "LAMB", unigram=7.0, cells=by_factor(runs),
                    grid=[8.0, 1.0, 4.0, 0.5, 2.0, 4.0])
    assert rows[0][-1] == "VR better by 0.100 nats (seed ranges apart)"
    # a gap between factors run beside the best: LAMB's ×2 between ×1 and ×4 on a grid that has ×1.5
    # and ×3 between them. Fails on the old code, which took any factor below and above as a bracket
    wide = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    rows = verdicts(best_cells(runs), "c", [64], "VR", "LAMB", unigram=7.0, cells=by_factor(runs), grid=wide)
    assert rows[0][-1] == ("not decided: LAMB's best LR ×2 has ×1.5 and ×3 beside it on the grid not run on 2 seeds; "
                           "VR's best LR ×4 has ×3 beside it on the grid not run on 2 seeds")
    # an arm short of seeds and the other's open bracket are both said. Fails on the old code, which
    # named the seeds only
    short = [r for r in runs if not (r["optimizer"] == "VR" and r["seed"] == 2)]
    rows = verdicts(best_cells(short), "c", [64], "VR", "LAMB", unigram=7.0, cells=by_factor(short), grid=wide)
    assert rows[0][-1] == ("not decided: VR lacks 2 seeds; LAMB's best LR ×2 has ×1.5 and ×3 beside it on the grid "
                           "not run on 2 seeds")
    results = [{"corpus": "c", "batch": 16, "optimizer": "VR", "factor": 1.0, "seed": 1}]
    assert unrun_cells(results, ["c"], [16], ["VR"], [1.0, 2.0], [1]) == ["c b16 VR ×2 seed 1"]


def test_the_unigram_level_rebuilds_a_stale_sample_index(tmp_path):
    """Data prepared again (an edited input, or inputs whose modification time changed) gets new
    shards, and the sample index of a seed other than ``prepare``'s own is left stale. The study's
    unigram level rebuilds it, as the training job does. Fails on the old code, which built the
    index only when the file was missing and so stopped on the stale one (a ``DataError``)."""
    from pydoc_data.topics import topics

    from vrgd_ds.data_pipeline.prepare import prepare

    sys.path.insert(0, str(STUDIES))
    from bert_batch import unigram_loss

    text = tmp_path / "corpus.txt"
    options = dict(vocab_size=400, seq_lens=(64,), seed=1, workers=1, progress=False, tokenizer_threads=1)

    def prepared(out: Path, documents: list[str]) -> Path:
        text.write_text("\n\n".join(" ".join(topics[k].split()) for k in documents) + "\n")
        prepare(out, text, **options)
        return out

    names = sorted(topics)
    data = prepared(tmp_path / "data", names[:30])
    unigram_loss(data, 2, 64, 16, 0.2)  # builds seed 2's index beside the shards
    prepared(data, names[10:40])  # the shards are rewritten; seed 2's index now names the old ones
    level = unigram_loss(data, 2, 64, 16, 0.2)
    assert level == unigram_loss(prepared(tmp_path / "fresh", names[10:40]), 2, 64, 16, 0.2)


def test_the_unigram_level_is_over_the_samples_the_job_evaluates_on_its_ranks(tmp_path):
    """On several ranks the job evaluates the first ``eval_samples`` held-out samples rounded down
    to a multiple of the ranks (``eval_batches``); the study's unigram level is over those same
    samples. Fails on the code before, which took the first ``eval_samples`` whatever the ranks."""
    from pydoc_data.topics import topics

    from vrgd_ds.data_pipeline.prepare import prepare

    sys.path.insert(0, str(STUDIES))
    from bert_batch import unigram_loss

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(" ".join(topics[k].split()) for k in sorted(topics)[:30]) + "\n")
    data = tmp_path / "data"
    prepare(data, text, vocab_size=400, seq_lens=(64,), seed=1, workers=1, progress=False, tokenizer_threads=1)
    on_two, six, seven = (unigram_loss(data, 1, 64, 7, 0.2, ranks=2), unigram_loss(data, 1, 64, 6, 0.2),
                          unigram_loss(data, 1, 64, 7, 0.2))
    # the same six samples' labels, in the ranks' order: the same mean to the summation's rounding
    assert on_two == pytest.approx(six, rel=1e-12) and abs(seven - six) > 1e-6


def bowl(optimum: float, seed: int, factor: float) -> float:
    """A loss over the LR factor with its minimum at ``optimum`` (seeds shift it alike)."""
    return 6.0 + 0.1 * math.log2(factor / optimum) ** 2 + 0.01 * seed


def test_a_diverged_run_ranks_last_in_its_bracket_and_a_tie_goes_to_the_lower_factor():
    """A run that diverged (recorded +inf) or whose held-out loss is NaN ranks below every finite
    factor, in the bracket and in the best LR alike, and equal means go to the lower factor in
    both. Fails on the old code: a NaN factor first in ``by_factor`` was chosen as the best LR
    (6.05 at ×0.5 passed over), and on a tie ``best_cells`` took the factor first run where the
    bracket took the lower."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import best_cells, bracket_step, by_factor

    def run(factor, seed, loss):
        return {"corpus": "c", "batch": 64, "optimizer": "LAMB", "factor": factor, "seed": seed, "mlm_loss": loss}

    grid = [0.25, 0.5, 1.0, 2.0]
    for bad in (math.nan, math.inf):
        runs = [run(1.0, 1, bad), run(1.0, 2, 6.0), run(0.5, 1, 6.05), run(0.5, 2, 6.05),
                run(0.25, 1, 6.2), run(0.25, 2, 6.2)]
        assert best_cells(runs)["c", 64, "LAMB"][0]["factor"] == 0.5, bad
        assert bracket_step(by_factor(runs)["c", 64, "LAMB"], 1.0, [1, 2], grid) == ([], 0.5), bad
    tied = [run(1.0, 1, 6.0), run(1.0, 2, 6.0), run(0.5, 1, 6.0), run(0.5, 2, 6.0), run(2.0, 1, 7.0),
            run(2.0, 2, 7.0), run(0.25, 1, 7.0), run(0.25, 2, 7.0)]
    assert best_cells(tied)["c", 64, "LAMB"][0]["factor"] == 0.5
    assert bracket_step(by_factor(tied)["c", 64, "LAMB"], 1.0, [1, 2], grid) == ([], 0.5)


#: a stand-in rank that logs two steps and an evaluation, then stops as the job does on divergence
DIVERGING_RANK = """
import json, sys, time
run_dir = sys.argv[3]
with open(run_dir + "/metrics.jsonl", "w") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "train/samples": 8.0}) + "\\n")
    fh.write(json.dumps({"step": 1, "eval/mlm_loss": 7.5, "eval/mlm_acc": 0.05}) + "\\n")
    fh.write(json.dumps({"step": 2, "time": time.time(), "train/samples": 16.0}) + "\\n")
sys.exit(4)
"""


def test_a_run_the_job_stops_as_diverged_is_recorded_as_diverged_not_failed(tmp_path):
    """The job's exit 4 (``EXIT_DIVERGED``: too many skipped steps in a row) is a result: the run
    is recorded with a loss of +inf and ``diverged``, not its last evaluation along the way, so the
    bracket moves past that LR. Fails on the old code, which took it for a failed run: never
    recorded, asked for again at every start, and the study exited 1 each time."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    run_dir = tmp_path / "diverging"
    launch = Launch(run_dir, [sys.executable, "-c", DIVERGING_RANK, "-m", "vrgd_ds.train", str(run_dir)], {},
                    {"corpus": "c", "batch": 8, "optimizer": "LAMB", "seed": 1, "lr": 1e-2, "factor": 4.0,
                     "steps": 10, "samples": 80}, tmp_path / "no-data")
    runner = Runner(argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=None))
    (result,) = runner.run([launch])
    assert runner.failed == [] and result["diverged"] is True and result["mlm_loss"] == math.inf
    assert json.loads((run_dir / "result.json").read_text())["mlm_loss"] == math.inf


def test_a_run_that_diverges_while_a_pause_waits_is_recorded(tmp_path):
    """A run the job stops as diverged (exit 4) just as the time limit pauses the runs: a result,
    recorded as diverged and kept, like one that finishes meanwhile. Fails on the code before,
    which reported it "stopped, removed" and deleted its directory, so the next start ran it
    again."""
    import argparse
    import subprocess

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    run_dir = tmp_path / "diverging"
    run_dir.mkdir()
    launch = Launch(run_dir, [], {}, {"corpus": "c", "batch": 8, "optimizer": "LAMB", "seed": 1, "lr": 1e-2,
                                      "factor": 4.0, "steps": 10, "samples": 80}, tmp_path / "no-data")
    proc = subprocess.Popen([sys.executable, "-c", DIVERGING_RANK, "-m", "vrgd_ds.train", str(run_dir)])
    proc.wait(timeout=60)
    runner = Runner(argparse.Namespace(parallel=1, time_limit=60, started=time.monotonic(), ranks=1, port=None))
    active, results = {0: (0, proc, time.monotonic() - 5.0, open(tmp_path / "log", "w"))}, [None]
    runner.pause_active([launch], active, results, None, 1.0, "--time-limit")
    assert active == {} and results[0]["diverged"] is True and runner.stopped == []
    assert json.loads((run_dir / "result.json").read_text())["mlm_loss"] == math.inf


@pytest.mark.parametrize("resumed", [False, True])
def test_a_run_that_crashes_while_a_pause_waits_is_a_failed_run_kept_with_its_log(tmp_path, capsys, resumed):
    """A run whose job crashes (exit 1: an exception, not the pause's SIGUSR1) while the pause
    waits is a failed run, its directory kept and its log's end printed, and the study exits 1;
    one the signal ended in its start-up (DeepSpeed's launcher exits -SIGUSR1 & 255) is still a
    stopped run, and one that checkpointed and exited (75) only after the pause judged it is left
    to the caller, not a failure. Fails on
    the code before, which reported the crash "stopped, removed" and deleted its directory with
    the log that said why (or, resumed, "kept at its last checkpoint"), and the study exited 0."""
    import argparse
    import signal
    import subprocess

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch, Runner

    def ended(name: str, code: int) -> tuple[Launch, subprocess.Popen]:
        run_dir = tmp_path / name
        run_dir.mkdir()
        if resumed:
            (run_dir / PAUSED).write_text(json.dumps([{"machine": "m", "wall_s": 9.0, "step": 1, "samples": 8}]))
        launch = Launch(run_dir, [], {}, {"corpus": "c", "batch": 8, "optimizer": name, "seed": 1, "lr": 1e-2,
                                          "factor": 1.0, "steps": 10, "samples": 80}, tmp_path / "no-data")
        (run_dir / "log.txt").write_text("Traceback (most recent call last):\nOSError: disk full\n")
        proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
        proc.wait(timeout=60)
        return launch, proc

    (crashed, p0), (signalled, p1) = ended("crashed", 1), ended("signalled", -signal.SIGUSR1 & 255)
    late, p2 = ended("late", 75)  # checkpointed and exited after the pause judged it: the pause's, not a failure
    runner = Runner(argparse.Namespace(parallel=3, time_limit=60, started=time.monotonic(), ranks=1, port=None))
    active = {slot: (slot, proc, time.monotonic() - 5.0, open(tmp_path / f"log{slot}", "w"))
              for slot, proc in enumerate((p0, p1, p2))}
    results = [None, None, None]
    runner.pause_active([crashed, signalled, late], active, results, None, 1.0, "--time-limit")
    assert [f["run"] for f in runner.failed] == [str(crashed.run_dir)] and results == [None, None, None]
    assert runner.failed[0]["returncode"] == 1 and "OSError: disk full" in runner.failed[0]["log_tail"]
    assert crashed.run_dir.is_dir() and 0 not in active and 2 in active
    assert [g["paused"] for g in runner.stopped] == [resumed]  # the signalled run alone
    out = capsys.readouterr().out
    assert f"run failed (1): {crashed.run_dir / 'log.txt'} (kept)" in out and f"{crashed.run_dir} stopped" not in out


def test_the_grid_takes_each_value_once_and_checks_the_batches_it_runs():
    """A repeated ``--lr-factor``, ``--seed`` or ``--batch`` ran one run directory twice and counted
    its result twice; with ``--noise-multiple`` the default ``--batch`` list, which that mode does
    not run, was checked against ``--groups`` and refused a valid study. Fails on the old code
    (no ``grid_of``: the checks sat in ``main``, as they were)."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import grid_of

    def args(**kw):
        return argparse.Namespace(**dict(batch=None, seed=None, lr_factor=None, bracket=None, bracket_carry=False,
                                         groups=None, ranks=1, micro_batch=8, noise_multiple=None) | kw)

    assert grid_of(args(batch=[64, 64, 128], seed=[2, 1, 2], lr_factor=[1.0, 0.5, 1.0])) == (
        [64, 128], [2, 1], [1.0, 0.5])
    assert grid_of(args(lr_factor=[1.0, 0.5, 1.0], bracket=1.0))[2] == [0.5, 1.0]
    assert grid_of(args(groups=12, noise_multiple=[1.0]))[0] == [64, 256, 1024]  # not run, not checked
    with pytest.raises(SystemExit, match="--batch 64: not a multiple of --groups 12"):
        grid_of(args(groups=12))


def test_bracket_runs_the_grid_only_where_an_optimum_needs_it():
    """``--bracket 1`` on the grid ×1/8–×4, round by round (``bracket_plan``): ×1 first, then
    its neighbours, then further down only for an optimizer whose best is still the lowest factor
    it ran. LAMB's optimum at ×1/4 and VR's at ×1 take 5 rounds, VR stops at ×1/2–×2 and neither
    runs ×4; an optimum below the grid stops at its edge (no verdict there: ``unbracketed``); a
    seed not run yet comes before any new factor of that optimizer."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import best_cells, bracket_plan, by_factor, unbracketed

    grid, labels, seeds = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0], ["LAMB", "VR"], [1, 2]

    def rounds(optima: dict[str, float]) -> tuple[list[list[tuple[str, float]]], list[dict]]:
        runs, factors = [], []
        while plan := bracket_plan(by_factor(runs), "c", 64, labels, seeds, grid, 1.0):
            assert len(plan) == len(set(plan)) and {s for _, _, s in plan} == set(seeds)
            factors.append(sorted({(lab, f) for lab, f, _ in plan}))
            runs += [{"corpus": "c", "batch": 64, "optimizer": lab, "factor": f, "seed": s,
                      "mlm_loss": bowl(optima[lab], s, f)} for lab, f, s in plan]
        return factors, runs

    both = [[("LAMB", 1.0), ("VR", 1.0)], [("LAMB", 0.5), ("LAMB", 2.0), ("VR", 0.5), ("VR", 2.0)]]
    factors, runs = rounds({"LAMB": 0.25, "VR": 1.0})
    assert factors == both + [[("LAMB", 0.25)], [("LAMB", 0.125)]]
    best = best_cells(runs)
    assert best["c", 64, "LAMB"][0]["factor"] == 0.25 and best["c", 64, "VR"][0]["factor"] == 1.0
    assert all(unbracketed(by_factor(runs), ("c", 64, lab), best["c", 64, lab], grid) is None for lab in labels)
    factors, runs = rounds({"LAMB": 0.01, "VR": 1.0})
    assert factors == both + [[("LAMB", 0.25)], [("LAMB", 0.125)]]  # the grid's lowest: no further
    assert unbracketed(by_factor(runs), ("c", 64, "LAMB"), best_cells(runs)["c", 64, "LAMB"], grid) == (
        "LAMB's best LR ×0.125 is the grid's lowest factor (×0.125–×4): extend --lr-factor below it")
    alone = [r for r in runs if r["optimizer"] == "VR" or r["factor"] == 0.125]  # its neighbour not run either
    assert unbracketed(by_factor(alone), ("c", 64, "LAMB"), best_cells(alone)["c", 64, "LAMB"], grid) == (
        "LAMB's best LR ×0.125 has ×0.25 beside it on the grid not run on 2 seeds, and is the grid's lowest factor "
        "(×0.125–×4): extend --lr-factor below it")
    one_seed = [r for r in runs if not (r["optimizer"] == "VR" and r["factor"] == 0.5 and r["seed"] == 2)]
    assert bracket_plan(by_factor(one_seed), "c", 64, labels, seeds, grid, 1.0) == [("VR", 0.5, 2)]
    assert bracket_plan(by_factor(runs), "c", 256, labels, [1], grid, 1.0) == [("LAMB", 1.0, 1), ("VR", 1.0, 1)]


def test_bracket_carry_starts_each_batch_at_the_lr_the_batch_below_settled_on():
    """``--bracket-carry`` (``carried_starts``): where the best LR does not grow with the batch as
    the square-root rule assumes (it stays at ×1 of batch 16's LR, so ×1/2 at 64 and ×1/4 at 256),
    each larger batch starts at the LR the batch below settled on, and the study brackets the same
    optima in fewer runs than when every batch starts at ×1. While the batch below has not
    settled (a seed missing), the next one starts where the batch below starts."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import best_cells, bracket_plan, by_factor, carried_starts, unbracketed

    grid, labels, seeds, batches = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0], ["LAMB", "VR"], [1, 2], [16, 64, 256]
    optima = {16: 1.0, 64: 0.5, 256: 0.25}  # one LR at every batch, as a factor of each one's sqrt-rule LR
    lr_of = lambda b: 0.004 * math.sqrt(b / 16)  # noqa: E731

    def study(carry: bool) -> list[dict]:
        runs: list[dict] = []
        while True:
            cells = by_factor(runs)
            starts = carried_starts(cells, "c", batches, labels, seeds, grid, 1.0, lr_of) if carry else {
                b: 1.0 for b in batches}
            plan = [(b, lab, f, s) for b in batches for lab, f, s in bracket_plan(cells, "c", b, labels, seeds,
                                                                                   grid, starts[b])]
            if not plan:
                return runs
            runs += [{"corpus": "c", "batch": b, "optimizer": lab, "factor": f, "seed": s,
                      "mlm_loss": bowl(optima[b], s, f)} for b, lab, f, s in plan]

    plain, carried = study(False), study(True)
    for runs in (plain, carried):
        best = best_cells(runs)
        assert {b: best["c", b, "LAMB"][0]["factor"] for b in batches} == optima
        assert all(unbracketed(by_factor(runs), ("c", b, lab), best["c", b, lab], grid) is None
                   for b in batches for lab in labels)
    assert len(carried) == 36 and len(plain) == 48  # 16: 12 runs either way; 64 and 256: 12 each, not 16 and 20
    assert {r["factor"] for r in carried if r["batch"] == 256} == {0.125, 0.25, 0.5}  # ×1 and ×2 never run

    # the batch below not settled yet: a seed missing at 64, so 256 starts at 64's start, ×1/2 → ×1/4
    some = [r for r in carried if not (r["batch"] == 64 and r["seed"] == 2)]
    starts = carried_starts(by_factor(some), "c", batches, labels, seeds, grid, 1.0, lr_of)
    assert starts == {16: {"LAMB": 1.0, "VR": 1.0}, 64: {"LAMB": 0.5, "VR": 0.5}, 256: {"LAMB": 0.25, "VR": 0.25}}
    # settled where it did not start: 16 run at ×1, ×2 and ×4 with its best at ×2 (bracketed), so 64
    # starts at ×1, the LR of 16's ×2; from 16's start it would be ×1/2. Another seed run at one
    # factor (seed 3 at ×1) does not unsettle it.
    off = [{"corpus": "c", "batch": 16, "optimizer": lab, "factor": f, "seed": s, "mlm_loss": bowl(2.0, s, f)}
           for lab in labels for f in (1.0, 2.0, 4.0) for s in seeds]
    off.append(dict(off[0], seed=3))
    assert carried_starts(by_factor(off), "c", batches, labels, seeds, grid, 1.0, lr_of)[64] == {"LAMB": 1.0,
                                                                                                 "VR": 1.0}
    # an optimum below the grid at 64: its best is the grid's lowest factor, where the bracket stops, so
    # 256 starts from it (×1/8 at 64 is ×1/16 at 256: off the grid, its edge)
    low = [dict(r, mlm_loss=bowl(0.01, r["seed"], r["factor"])) if r["batch"] == 64 else r for r in carried]
    low += [{"corpus": "c", "batch": 64, "optimizer": lab, "factor": 0.125, "seed": s,
             "mlm_loss": bowl(0.01, s, 0.125)} for lab in labels for s in seeds]
    assert carried_starts(by_factor(low), "c", batches, labels, seeds, grid, 1.0, lr_of)[256]["LAMB"] == 0.125
    # nothing settled, batches doubling: each start carries the LR unrounded (×1/√2 at 128, ×1/2 at 256,
    # ×1/√8 at 512), and halfway between two factors the lower one is taken
    doubling = carried_starts({}, "c", [512, 64, 128, 256], ["LAMB"], seeds, grid, 1.0, lambda b: math.sqrt(b))
    assert {b: st["LAMB"] for b, st in doubling.items()} == {64: 1.0, 128: 0.5, 256: 0.5, 512: 0.25}


def test_bracket_rounds_gather_what_finished_and_list_what_is_needed_next(monkeypatch):
    """``run_bracketed``: the runs of the grid that finished before are read first (none run
    again, and they count: a factor run before is in play), then rounds of what the bracket
    needs, at every batch; when the time is over (the runner sets ``only_finished``) the study
    stops and lists the runs needed next, not the whole grid."""
    sys.path.insert(0, str(STUDIES))
    import argparse

    import bert_batch

    optima = {("LAMB", 16): 0.5, ("VR", 16): 0.5, ("LAMB", 64): 0.25, ("VR", 64): 1.0}

    def result(label, corpus, data, batch, f, seed):
        return {"corpus": corpus, "batch": batch, "optimizer": label, "factor": f, "seed": seed,
                "mlm_loss": bowl(optima[label, batch], seed, f)}

    finished = {(16, lab, f, s) for lab in ("LAMB", "VR") for f in (0.5, 1.0) for s in (1, 2)}
    monkeypatch.setattr(bert_batch, "plan_run", lambda label, corpus, data, batch, f, seed, args: (
        result(label, corpus, data, batch, f, seed) if (batch, label, f, seed) in finished
        else None if args.only_finished else "launch"))
    ran: list[list[tuple]] = []

    def run_all(cells, args, record, finish=None):  # the time runs out after 3 rounds, or as ``finish`` says
        ran.append([(c[3], c[0], c[4], c[5]) for c in cells])
        args.only_finished = len(ran) == 3 if finish is None else True
        done = [result(*c) for c in cells[:finish]]
        for r in done:
            record(r)
        return done

    monkeypatch.setattr(bert_batch, "run_all", run_all)
    recorded = []
    args = argparse.Namespace(only_finished=False, bracket=1.0)
    results, unrun = bert_batch.run_bracketed("c", Path("data"), [16, 64], ["LAMB", "VR"], [1, 2],
                                              [0.25, 0.5, 1.0, 2.0], args, recorded.append)
    assert len(recorded) == len(results) == 8 + sum(map(len, ran))
    assert not {(b, lab, f, s) for cells in ran for b, lab, f, s in cells} & finished
    assert [sorted({(b, f) for b, _, f, _ in cells}) for cells in ran] == [
        [(16, 0.25), (64, 1.0)], [(64, 0.5), (64, 2.0)], [(64, 0.25)]]
    assert unrun == []  # ×1/4 is the grid's edge at 64; 16 bracketed by ×1/4 and ×1
    ran.clear()
    args = argparse.Namespace(only_finished=False, bracket=1.0)
    monkeypatch.setattr(bert_batch, "run_all", lambda cells, args, record: run_all(cells, args, record, finish=4))
    results, unrun = bert_batch.run_bracketed("c", Path("data"), [16, 64], ["LAMB", "VR"], [1, 2],
                                              [0.25, 0.5, 1.0, 2.0], args, recorded.append)
    assert len(ran) == 1 and unrun == ["c b64 LAMB ×1 seed 1", "c b64 LAMB ×1 seed 2", "c b64 VR ×1 seed 1",
                                       "c b64 VR ×1 seed 2"]  # ×1/4 at 16 finished; 64 not started
    # --bracket-carry: 64 starts where 16 starts (×1 there, ×1/2 at 64 by the square-root rule) while 16
    # has not settled, so the first round runs ×1/2 at 64, not ×1
    ran.clear()
    args = argparse.Namespace(only_finished=False, bracket=1.0, bracket_carry=True, base_lr=0.004, base_batch=16,
                              lr_rule="sqrt")
    results, unrun = bert_batch.run_bracketed("c", Path("data"), [16, 64], ["LAMB", "VR"], [1, 2],
                                              [0.25, 0.5, 1.0, 2.0], args, recorded.append)
    assert [sorted({(b, f) for b, _, f, _ in cells}) for cells in ran] == [[(16, 0.25), (64, 0.5)]]


@pytest.mark.slow
@pytest.mark.exhaustive  # the study script end to end on recorded runs (10 s): make test-all
def test_batches_at_noise_multiples_get_a_verdict_each_and_the_unrun_cells_are_listed(tmp_path):
    """The study past the plateau (``--noise-multiple``): batches at 1× and 4× a B_simple of 16
    samples (16 and 64), LAMB against VR-LAMB at each one's best LR over 2 seeds. A verdict needs
    both seeds on both sides and the best LR bracketed; "better" only when the seed ranges are apart; LAMB's degradation
    from the first batch to the last and the share VR-LAMB recovers; every run of the grid not
    yet run is listed (the record grows piecewise). Multiples given in any order, or rounding to
    the same batch, give each batch once (before, a batch given twice counted one seed twice)."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import measured_noise_scale, noise_batches

    assert noise_batches([1, 4, 16, 64], 20.0, 8) == [24, 80, 320, 1280] and noise_batches([0.1], 20.0, 8) == [8]
    assert measured_noise_scale([{"batch": 64, "b_simple": 10.0}, {"batch": 64, "b_simple": 30.0},
                                 {"batch": 16, "b_simple": 99.0}, {"batch": 64, "b_simple": None}], 64) == 20.0
    # a probe a time limit left with one seed gives no batches yet: fails on the code before, which took
    # that seed's B_simple, and the next lease, with both, other batches
    probe = [{"batch": 64, "seed": 1, "b_simple": 100.0}, None]
    assert measured_noise_scale(probe, 64, [1, 2]) is None
    assert measured_noise_scale(probe + [{"batch": 64, "seed": 2, "b_simple": 300.0}], 64, [1, 2]) == 200.0
    best_runs = {(16, "LAMB"): (6.50, 6.60), (16, "VR-LAMB first_moment"): (6.55, 6.58),
                 (64, "LAMB"): (6.90, 6.95), (64, "VR-LAMB first_moment"): (6.70, 6.75)}
    # ×1 best, bracketed by ×0.5 and ×2 on both seeds; ×4 run once (LAMB at 16, seed 1), the rest not yet
    runs = [("embedded", batch, label, f, s, loss + worse) for (batch, label), losses in best_runs.items()
            for f, worse in ((0.5, 0.3), (1.0, 0.0), (2.0, 0.2)) for s, loss in zip((1, 2), losses)]
    runs.append(("embedded", 16, "LAMB", 4.0, 1, 6.70))
    study = fake_study(tmp_path / "a", runs)
    run_study("bert_batch.py", "--only-finished", "--corpus", "embedded", "--optimizer", "LAMB", "--optimizer",
              "VR-LAMB first_moment", "--noise-multiple", "4", "--noise-multiple", "1", "--noise-multiple", "1.05",
              "--noise-scale", "16",  # ×1.05 rounds to batch 16 again: one cell, not two
              "--lr-factor", "0.5", "--lr-factor", "1", "--lr-factor", "2", "--lr-factor", "4",
              "--work", str(tmp_path / "work"), "--reuse", str(study), "--out", str(tmp_path / "out"))
    tables = (tmp_path / "out" / "tables.md").read_text()
    assert "Verdict per batch (multiples ×1, ×1.05, ×4 of B_simple; unigram level, nats: not computed; 7 run(s)" \
        in tables
    # no data prepared in --work: no unigram level, so no verdict (the verdicts themselves: the in-process test above)
    undecided = "not decided: the unigram level is not computed (no prepared data) |"
    assert f"| embedded | 16 | 6.550 (6.500–6.600) | 6.565 (6.550–6.580) | 1: +0.050, 2: -0.020 | – | {undecided}" \
        in tables
    assert f"| embedded | 64 | 6.925 (6.900–6.950) | 6.725 (6.700–6.750) | 1: -0.200, 2: -0.200 | – | {undecided}" \
        in tables
    assert ("| embedded | 16 → 64 | LAMB loses +0.375 | VR-LAMB first_moment recovers +0.200 |  |  | not decided: batch "
            "16: the unigram level is not computed (no prepared data); batch 64: the unigram level is not computed (no "
            "prepared data) |") in tables
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["unrun"] == ["embedded b16 LAMB ×4 seed 2", "embedded b16 VR-LAMB first_moment ×4 seed 1",
                             "embedded b16 VR-LAMB first_moment ×4 seed 2", "embedded b64 LAMB ×4 seed 1",
                             "embedded b64 LAMB ×4 seed 2", "embedded b64 VR-LAMB first_moment ×4 seed 1",
                             "embedded b64 VR-LAMB first_moment ×4 seed 2"]
    assert meta["noise_scale"] == {"embedded": 16.0}
    # the settings name the batches run, not the default --batch grid (fails on the code before:
    # [64, 256, 1024], which the results page printed for studies at 800 to 50,944)
    assert meta["config"]["batches"] == [16, 64]
    # --bracket 1: the same runs, and only what a bracket needs is listed: LAMB's ×4 at 16, run on
    # one seed, on the other; nothing for VR-LAMB (bracketed by ×0.5 and ×2) nor at 64
    run_study("bert_batch.py", "--only-finished", "--bracket", "1", "--corpus", "embedded", "--optimizer", "LAMB",
              "--optimizer", "VR-LAMB first_moment", "--noise-multiple", "1", "--noise-multiple", "4",
              "--noise-scale", "16", "--lr-factor", "4", "--lr-factor", "2", "--lr-factor", "1", "--lr-factor", "0.5",
              "--work", str(tmp_path / "work"), "--reuse", str(study), "--out", str(tmp_path / "bracket"))
    meta = json.loads((tmp_path / "bracket" / "meta.json").read_text())
    assert meta["config"]["bracket"] == 1.0 and meta["config"]["lr_factors"] == [0.5, 1.0, 2.0, 4.0]
    assert meta["unrun"] == ["embedded b16 LAMB ×4 seed 2"]
    assert ("unigram level, nats: not computed; 1 run(s) the bracket's next round needs; each optimizer's best LR is chosen "
            "on the held-out loss it is judged by)") in (tmp_path / "bracket" / "tables.md").read_text()
    assert f"| embedded | 64 | 6.925 (6.900–6.950) | 6.725 (6.700–6.750) | 1: -0.200, 2: -0.200 | – | {undecided}" in (
        tmp_path / "bracket" / "tables.md").read_text()


def test_runs_set_beside_another_machines_runs_of_the_same_cells(tmp_path):
    """``--compare``: each run made here against the same cell and seed of another output, with the
    tolerance of 1e-3 of the loss the run trained away (from its step-0 evaluation), and whether
    both read the same data; reused runs and cells the other output lacks are left out, and so is
    the other output's run of a cell at another length. Before, the record's last run of a cell
    was taken whatever its steps (fails on the old code)."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import compared

    other = fake_study(tmp_path / "cpu", [("wikitext", 64, "LAMB", 1.0, s, loss) for s, loss in ((1, 7.0), (2, 7.1))])
    lines = (other / "runs.jsonl").read_text().splitlines()
    longer = json.loads(lines[0]) | {"steps": 320, "mlm_loss": 6.5}  # the same cell, twice the steps
    (other / "runs.jsonl").write_text("".join(json.dumps(r | {"data": "fp"}) + "\n"
                                              for r in [*map(json.loads, lines), longer]))
    start = [{"step": 0, "mlm_loss": 9.0}, {"step": 50, "mlm_loss": 7.0}]
    here = [{"corpus": "wikitext", "batch": 64, "optimizer": "LAMB", "factor": 1.0, "seed": 1, "mlm_loss": 7.001,
             "data": "fp", "trajectory": start},
            {"corpus": "wikitext", "batch": 64, "optimizer": "LAMB", "factor": 1.0, "seed": 2, "mlm_loss": 7.15,
             "data": "other", "trajectory": start},
            {"corpus": "wikitext", "batch": 64, "optimizer": "LAMB", "factor": 2.0, "seed": 1, "mlm_loss": 6.0},
            {"corpus": "wikitext", "batch": 64, "optimizer": "LAMB", "factor": 1.0, "seed": 1, "mlm_loss": 7.0,
             "reused_from": "x"}]
    for r in here:
        r["steps"] = 160
    config = json.loads((other / "meta.json").read_text())["config"]
    rows = compared(here, other, config)
    assert [(r["cell"], r["within"], r["same_data"]) for r in rows] == [
        ("wikitext b64 LAMB ×1 seed 1", True, True), ("wikitext b64 LAMB ×1 seed 2", False, False)]
    assert rows[0]["tolerance"] == pytest.approx(1e-3 * (9.0 - 7.001)) and rows[1]["difference"] == pytest.approx(0.05)
    # runs of another setting are not the same job: dropout on there, off here
    with pytest.raises(SystemExit, match="--compare .*: its runs used dropout=None, this study 0.0"):
        compared(here, other, config | {"dropout": 0.0})


@pytest.mark.exhaustive
def test_a_lease_in_which_no_run_finished_still_leaves_a_record_the_next_one_reuses(tmp_path):
    """With ``--time-limit`` and no run finished (a lease spent on set-up), the study still writes
    its record: the cells listed as not run, an empty ``runs.jsonl``, and a directory that
    ``--reuse`` reads. Fails on the code before: it stopped ("no finished or reused run") and left
    no ``meta.json``, so the next lease's ``--reuse`` stopped too."""
    args = ["--only-finished", "--time-limit", "300", "--corpus", "embedded", "--batch", "64", "--optimizer", "LAMB",
            "--lr-factor", "1", "--seed", "1", "--work", str(tmp_path / "work")]
    run_study("bert_batch.py", *args, "--out", str(tmp_path / "first"))
    meta = json.loads((tmp_path / "first" / "meta.json").read_text())
    assert meta["unrun"] == ["embedded b64 LAMB ×1 seed 1"] and (tmp_path / "first" / "runs.jsonl").read_text() == ""
    run_study("bert_batch.py", *args, "--reuse", str(tmp_path / "first"), "--out", str(tmp_path / "second"))
    assert json.loads((tmp_path / "second" / "meta.json").read_text())["unrun"] == meta["unrun"]


#: a stand-in for one job run: notes its start, port and end, sleeps, writes an evaluation record
FAKE_RUN = """
import json, sys, time
run_dir, port, sleep = sys.argv[1], sys.argv[2], float(sys.argv[3])
t0 = time.time()
with open(run_dir + "/metrics.jsonl", "w") as fh:
    step = 0
    while time.time() - t0 < sleep:  # a step of 8 samples every 0.5 s, logged as the job logs it
        time.sleep(min(0.5, max(0.0, sleep - (time.time() - t0))))
        step += 1
        fh.write(json.dumps({"step": step, "time": time.time(), "train/samples": 8.0 * step}) + "\\n")
        fh.flush()
    fh.write(json.dumps({"step": step, "eval/mlm_loss": 6.0, "eval/mlm_acc": 0.1, "span": [t0, time.time()],
                         "port": port}))
"""


def stand_in(run_dir: Path, sleep: float, samples: int = 800, script: str = FAKE_RUN):
    """A planned run of the study (``bert_batch.Launch``) whose process is ``script`` (a stand-in
    for the job, given its directory, master port and seconds to run) rather than a job."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch

    return Launch(run_dir, [sys.executable, "-c", script, str(run_dir), "PORT", str(sleep)], {},
                  {"corpus": "c", "batch": 8, "optimizer": run_dir.name, "seed": 1, "lr": 1e-3, "factor": 1.0,
                   "steps": 1000, "samples": samples}, run_dir.parent / "no-data")


def test_study_runner_runs_side_by_side_within_its_time_limit(tmp_path):
    """``--parallel 2`` runs two runs at once, each on its own master port; ``--time-limit`` stops
    a run still going at the limit (its directory removed, not recorded), does not start a run
    the time left cannot hold at the rate of the runs finished so far, and leaves the study to
    assemble what finished (``only_finished``), each finished run recorded as it finished."""
    import argparse
    import time

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner

    def launch(name: str, sleep: float, samples: int):
        return stand_in(tmp_path / name, sleep, samples)

    args = argparse.Namespace(parallel=2, time_limit=Runner.ASSEMBLY_S + Runner.PAUSE_S + 8, started=time.monotonic(),
                              ranks=1, port=29900)
    recorded = []
    t0 = time.monotonic()
    a, b, c, d = Runner(args).run([launch("a", 1.5, 100), launch("b", 1.5, 100), launch("c", 120, 100),
                                   launch("d", 0, 10**9)], recorded.append)
    assert time.monotonic() - t0 < 60  # c was stopped, not waited for
    assert sorted(r["optimizer"] for r in recorded) == ["a", "b"]
    spans = [json.loads((tmp_path / n / "metrics.jsonl").read_text().splitlines()[-1]) for n in ("a", "b")]
    assert spans[0]["span"][0] < spans[1]["span"][1] and spans[1]["span"][0] < spans[0]["span"][1]  # at once
    assert {spans[0]["port"], spans[1]["port"]} == {"29900", "29901"}
    assert a["mlm_loss"] == b["mlm_loss"] == 6.0 and (tmp_path / "a" / "result.json").is_file()
    assert c is None and not (tmp_path / "c").exists()  # stopped unfinished, removed (not a job: no pause)
    (stopped,) = args.stopped  # how far c got, for the next lease to plan with
    assert stopped["run"] == "c b8 c ×1 seed 1" and stopped["step"] >= 2
    assert stopped["samples"] == 8.0 * stopped["step"]
    assert 0 < stopped["samples_per_s"] <= 16.0 and 0 <= stopped["setup_s"] < stopped["wall_s"]
    assert stopped["paused"] is False
    assert d is None and not (tmp_path / "d").exists()  # 10^9 samples: never started
    assert args.only_finished is True
    # the next Runner of the study (a --bracket round) knows the rates: 10^9 samples would not fit either
    args.time_limit, args.only_finished = 10**6, False
    assert Runner(args).rates == Runner(args).rates != [] and not Runner(args).fits(launch("e", 0, 10**9))


@pytest.mark.exhaustive  # make test: the runner paused at its --time-limit (test_study_runner_runs_side_by_side...)
def test_sigusr1_to_a_study_without_a_time_limit_pauses_its_runs_and_starts_no_more(tmp_path, capsys):
    """``kill -USR1`` to the study (``pause_on_signal``) takes the time limit's way out at once: the
    run in flight is paused (here a stand-in that is no job, so it is stopped and removed), the
    runs not started stay so (listed), the finished one is recorded, and later cells assemble from
    what finished. A study without ``--time-limit`` (a long CPU run) can so be stopped and resumed."""
    import argparse
    import threading

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner, pause_on_signal

    def launch(name: str, sleep: float):
        return stand_in(tmp_path / name, sleep)

    args = argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=29900)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        pause_on_signal(args)
        first = tmp_path / "a" / "result.json"
        sender = threading.Thread(target=lambda: (wait_until(first.exists, str(first)), time.sleep(3.0),
                                                  os.kill(os.getpid(), signal.SIGUSR1)))
        sender.start()
        t0 = time.monotonic()
        a, c, d = Runner(args).run([launch("a", 1.0), launch("c", 120), launch("d", 0)])
        sender.join()
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert time.monotonic() - t0 < 60  # c was paused at the signal, not waited for
    assert a["mlm_loss"] == 6.0 and c is None and d is None
    (stopped,) = args.stopped
    assert stopped["run"] == "c b8 c ×1 seed 1" and stopped["step"] >= 2
    assert not (tmp_path / "d").exists() and args.only_finished is True
    out = capsys.readouterr().out
    assert "SIGUSR1: pausing the runs in flight" in out and f"SIGUSR1: {tmp_path / 'c'} stopped, removed" in out
    assert f"SIGUSR1: paused: 1 run(s) not started (the first: {tmp_path / 'd'})" in out


#: a study (``bert_batch.Runner`` with the signal handling of ``main``) of one long stand-in run
TERMINATED_STUDY = """
import argparse, json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from bert_batch import Runner, pause_on_signal
from test_studies import stand_in
args = argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=None)
pause_on_signal(args)
Runner(args).run([stand_in(Path(sys.argv[3]), 120)])
"""


@pytest.mark.exhaustive  # about 7 s (make test: the runs stopped together, test_stopping_runs_gives_them_one_deadline_together)
def test_sigterm_to_a_study_stops_its_runs_with_it(tmp_path):
    """``timeout`` ends a study with SIGTERM (``benchmarks/gpu_suite.sh``'s parts); the study's
    runs are in sessions of their own, which the signal does not reach: the study stops them
    (``Runner.run``'s way out on a failure) and exits 143. Fails on the old code, which had no
    SIGTERM handler: the study died at once and its run went on, on the machine the next parts
    timed."""
    run_dir = tmp_path / "r"
    study = subprocess.Popen([sys.executable, "-c", TERMINATED_STUDY, str(STUDIES), str(Path(__file__).parent),
                              str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until((run_dir / "metrics.jsonl").exists, "the study's run", timeout=60)
        study.send_signal(signal.SIGTERM)
        study.wait(timeout=60)
        left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    finally:
        study.kill()
        subprocess.run(["pkill", "-f", str(run_dir)], check=False)
    assert study.returncode == 143, study.stdout.read()[-2000:]
    assert left == [], f"the study's run outlived it: {left}"
    assert not run_dir.exists()  # stopped unfinished (not a job: no checkpoint), removed


def test_stopping_runs_gives_them_one_deadline_together():
    """Three runs in sessions of their own that ignore SIGTERM: ``stop`` ends all three within one
    grace period, not one after another, so a study ended by ``timeout -k 15`` stops all its runs
    before its own SIGKILL. Fails on the code before, which waited 20 s for each in turn (here
    at least 6 s for 3 runs at a grace of 2 s)."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import stop

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)
             for _ in range(3)]
    try:
        for proc in procs:
            proc.stdout.readline()  # its handler is in place
        t0 = time.monotonic()
        stop(*procs, grace=2.0)
        took = time.monotonic() - t0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * 3
    assert took < 5.0, took


#: a stand-in run that listens on its master port while it runs, as the launcher's rendezvous does
LISTENING_RUN = """
import socket, sys
rendezvous = socket.socket()
rendezvous.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
rendezvous.bind(("", int(sys.argv[2])))  # EADDRINUSE where another run holds it: the run fails
rendezvous.listen()
""" + FAKE_RUN


@pytest.mark.exhaustive  # make test: runs side by side on ports of their own (test_study_runner_runs_side_by_side...)
def test_studies_side_by_side_take_free_ports_and_a_taken_port_is_named(tmp_path):
    """Two studies on one machine (two CPU cells of a plateau study, a study beside the tests),
    each with the command line's defaults: each run listens on its master port as the
    launcher's rendezvous does, and both runs finish, on ports of their own. A ``--port`` in use
    stops the study before its run starts, naming ``--port``; with two slots, before the first
    slot's run starts when the second's port is the one in use. Fails on the code before: every
    study took ``--port`` 29671 + slot by default, and the second study's run failed at its
    rendezvous (EADDRINUSE), which stopped that study."""
    import argparse
    import socket
    import threading

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner, parser

    def launch(name: str, sleep: float):
        return stand_in(tmp_path / name, sleep, script=LISTENING_RUN)

    def study(name: str, sleep: float, results: dict, **options) -> None:
        args = vars(parser().parse_args([])) | {"started": time.monotonic()} | options
        try:
            results[name] = Runner(argparse.Namespace(**args)).run([launch(name, sleep)])[0]
        except SystemExit as e:
            results[name] = str(e)

    results: dict = {}
    first = threading.Thread(target=study, args=("a", 4.0, results))
    first.start()
    wait_until((tmp_path / "a" / "metrics.jsonl").exists, "the first study's run")  # listening by now
    study("b", 1.0, results)
    first.join()
    assert isinstance(results["a"], dict) and isinstance(results["b"], dict), results
    ports = [json.loads((tmp_path / n / "metrics.jsonl").read_text().splitlines()[-1])["port"] for n in "ab"]
    assert ports[0] != ports[1]

    with socket.socket() as held:  # something else listens on the port asked for
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        study("c", 1.0, results, port=port)
        # two slots, the second's port held: stopped before the first run starts, not after (which
        # would stop that run and remove its directory)
        started = []

        class Watched(Runner):
            def start(self, launch, slot: int):
                started.append(launch.run_dir.name)
                return super().start(launch, slot)

        args = vars(parser().parse_args([])) | {"started": time.monotonic(), "port": port - 1, "parallel": 2}
        with pytest.raises(SystemExit, match=f"--port {port - 1}: port"):
            Watched(argparse.Namespace(**args)).run([launch("d", 1.0), launch("e", 1.0)])
        assert started == []
    assert results["c"].startswith(f"--port {port}: port {port} (run slot 0) is in use on this host")
    assert not (tmp_path / "c").exists()  # stopped before the run's directory was made


def test_the_runs_get_tcmalloc_where_it_is_installed_unless_the_caller_preloads_another(monkeypatch):
    """The runs' environment preloads tcmalloc where the loader finds it (``cpu_allocator``: a CPU
    run's activations are then not unmapped and faulted in anew every micro-step), nothing where
    it is missing (glibc's malloc), and keeps an ``LD_PRELOAD`` the caller set."""
    import argparse
    import ctypes.util

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner

    args = argparse.Namespace(parallel=1, time_limit=None, started=0.0, ranks=1, port=29900)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(ctypes.util, "find_library", found.get)
    assert Runner(args).env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    found.clear()
    assert "LD_PRELOAD" not in Runner(args).env
    monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so.2")
    found["tcmalloc_minimal"] = "libtcmalloc_minimal.so.4"
    assert Runner(args).env["LD_PRELOAD"] == "libjemalloc.so.2"


def test_a_run_with_slow_steps_is_signalled_earlier_than_the_pause_window(tmp_path):
    """A pause signal waits for the step in flight, so a run whose steps take longer than the pause
    window is signalled twice its slowest recent step (and 15 s for the checkpoint) before the
    limit. Fails on the code before: every run was signalled ``PAUSE_S`` (45 s) before it, and two
    16× CPU runs of about 68 s a step were stopped and removed, not paused."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    def launch(name: str, times: list[float]) -> Launch:
        run_dir = tmp_path / name
        run_dir.mkdir()
        rows = [{"step": k + 1, "time": 1000.0 + t, "train/samples": 8.0 * (k + 1)} for k, t in enumerate(times)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return Launch(run_dir, [], {}, {"samples": 8 * 128}, tmp_path / "no-data")

    fast, slow, one = launch("fast", [0, 2, 4, 6]), launch("slow", [0, 60, 128, 196, 260]), launch("one", [0])
    assert (fast.step_s(), slow.step_s(), one.step_s()) == (2.0, 68.0, None)
    runner = Runner(argparse.Namespace(parallel=2, time_limit=600, started=0.0, ranks=1, port=29900))
    started = time.monotonic() - (time.time() - 1000.0)  # each run's start: its first step's time
    assert runner.lead([fast, one], {0: (0, None, started), 1: (1, None, started)}) == Runner.PAUSE_S
    assert runner.lead([fast, slow], {0: (0, None, started), 1: (1, None, started)}) == 2 * 68.0 + 15.0


def test_a_runs_record_says_how_much_of_its_step_time_went_waiting_for_data(tmp_path):
    """Each finished run's record and each run the time limit stopped carry ``data_wait``: the
    job's ``train/data_time_s`` summed over its steps against ``train/step_time_s`` (for a stopped
    run, over its own segment), so a record says whether the DataLoader bounded the run. 8 runs
    side by side on an H200 made 4,262-5,200 samples/s each, and nothing recorded whether data
    was the limit."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    rows = [{"step": 1, "time": now - 500.0, "train/samples": 8.0, "train/step_time_s": 4.0, "train/data_time_s": 4.0},
            {"step": 2, "time": now - 20.0, "train/samples": 16.0, "train/step_time_s": 2.0, "train/data_time_s": 0.5},
            {"step": 3, "time": now - 10.0, "train/samples": 24.0, "train/step_time_s": 2.0, "train/data_time_s": 0.3}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    launch = Launch(run_dir, [], {}, {"corpus": "c", "batch": 8, "optimizer": "o", "seed": 1, "factor": 1.0,
                                      "steps": 10, "samples": 80}, tmp_path / "no-data")
    assert launch.data_wait() == pytest.approx(4.8 / 8.0)
    assert launch.progress(wall_s=100.0)["data_wait"] == pytest.approx(0.8 / 4.0)  # this segment's steps
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": now, "train/samples": 8.0}) + "\n")
    assert launch.data_wait() is None  # a job that logs no data time


def test_a_finished_runs_result_is_written_before_its_checkpoints_go(tmp_path, monkeypatch):
    """A stop (SIGTERM: ``end_on_sigterm`` raises ``SystemExit``) while a finished run's checkpoints
    are removed leaves its result: the next start counts it finished, not a directory to clear and
    run again (hours for a 64× run on a CPU). Fails on the code before, which removed the pause
    marker and the checkpoints before it wrote ``result.json``."""
    sys.path.insert(0, str(STUDIES))
    import bert_batch

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": time.time(), "train/samples": 8.0}) + "\n")
    launch = bert_batch.Launch(run_dir, [], {}, {"corpus": "c", "batch": 8, "optimizer": "o", "seed": 1,
                                                 "factor": 1.0, "steps": 1, "samples": 8}, tmp_path / "no-data")

    def stopped(*args, **kwargs):
        raise SystemExit(143)

    monkeypatch.setattr(bert_batch.shutil, "rmtree", stopped)
    with pytest.raises(SystemExit):
        launch.result(wall_s=5.0, machine="here", diverged=True)
    assert json.loads((run_dir / "result.json").read_text())["diverged"] is True
    assert not (run_dir / "result.json.partial").exists()


def test_a_resumed_runs_pause_lead_counts_its_own_steps_only(tmp_path):
    """A run paused at step 3 and resumed two days later: the gap between its last step before the
    pause and its first one after is no step time. Fails on the code before, which took it for
    one (172,800 s) and signalled the resumed 16× runs to pause again after two steps."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    now = time.time()
    times = [now - 172_900.0, now - 172_870.0, now - 172_840.0, now - 100.0, now - 70.0, now - 40.0]
    rows = [{"step": k + 1, "time": t, "train/samples": 8.0 * (k + 1)} for k, t in enumerate(times)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    resumed = Launch(run_dir, [], {}, {"samples": 8 * 128}, tmp_path / "no-data")
    runner = Runner(argparse.Namespace(parallel=1, time_limit=6000, started=0.0, ranks=1, port=29900))
    started = time.monotonic() - 150.0  # this segment began 150 s ago
    assert runner.lead([resumed], {0: (0, None, started)}) == 2 * 30.0 + 15.0
    assert resumed.step_s(since=now - 150.0) == 30.0


#: a stand-in for one rank at a pause: logs a step, then either checkpoints on SIGUSR1 (the marker)
#: and hangs on its way out ("hang"), or never answers the signal ("deaf")
PAUSING_RANK = """
import json, signal, sys, time
run_dir, mode = sys.argv[3], sys.argv[4]
def on_usr1(*_):
    open(run_dir + "/requeue.json", "w").write("{}")
    while True:
        time.sleep(1)
signal.signal(signal.SIGUSR1, on_usr1 if mode == "hang" else signal.SIG_IGN)
with open(run_dir + "/metrics.jsonl", "w") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "train/samples": 8.0}) + "\\n")
print("step 1 done", flush=True)
while True:
    time.sleep(1)
"""


def test_a_run_that_checkpointed_but_did_not_exit_is_kept_paused_and_a_removed_run_shows_its_log(tmp_path, capsys):
    """At the limit a run whose job has checkpointed (``requeue.json``, written after the complete
    save) but whose process is still on its way out (e.g. in its process group's teardown) is
    stopped and kept as paused, its segment recorded; a run that never checkpointed is stopped and
    removed, and the end of its log is printed, as its directory goes. Fails on the code before:
    the first was removed with its checkpoint (two 16× runs on an H200 at steps 117 and 119 of
    128 were removed so, and no log said why)."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch, Runner

    def launch(name: str, mode: str) -> Launch:
        run_dir = tmp_path / name
        return Launch(run_dir, [sys.executable, "-c", PAUSING_RANK, "-m", "vrgd_ds.train", str(run_dir), mode], {},
                      {"corpus": "c", "batch": 8, "optimizer": name, "seed": 1, "lr": 1e-3, "factor": 1.0,
                       "steps": 10, "samples": 80}, tmp_path / "no-data")

    runner = Runner(argparse.Namespace(parallel=2, time_limit=600, started=time.monotonic(), ranks=1, port=29900))
    hang, deaf = launch("hang", "hang"), launch("deaf", "deaf")
    active = {slot: (slot, *runner.start(one, slot)) for slot, one in enumerate((hang, deaf))}
    try:
        deadline = time.monotonic() + 60
        while not all("step 1 done" in (one.run_dir / "log.txt").read_text() for one in (hang, deaf)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert runner.pause([hang, deaf], active, 3.0) == [0]
        assert active[0][1].poll() is not None  # stopped, not left running
        assert [g["step"] for g in hang.segments()] == [1] and (hang.run_dir / PAUSED).is_file()
        assert [g["paused"] for g in runner.stopped] == [True, False]
        # the 3 s the pause waited for them count 2 runs side by side in each one's wall time. Fails
        # on the code before, which counted none of it (a CPU record's 0.64 runs at --parallel 1)
        for got in runner.stopped:
            assert got["side_by_side"] * got["wall_s"] == pytest.approx(2 * 3.0, abs=0.3), got
        assert "    | step 1 done" in capsys.readouterr().out
    finally:
        for _, proc, _, log in active.values():  # what Runner.run does with the slots not paused
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


#: a stand-in for one rank whose step in flight at SIGUSR1 takes 4 s more, then checkpoints and exits
LONG_STEP_AT_PAUSE_RANK = """
import json, signal, sys, time
run_dir, asked = sys.argv[3], []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
with open(run_dir + "/metrics.jsonl", "w") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "train/samples": 8.0}) + "\\n")
print("step 1 done", flush=True)
while not asked:
    time.sleep(0.1)
time.sleep(4.0)
open(run_dir + "/requeue.json", "w").write("{}")
sys.exit(75)
"""


@pytest.mark.exhaustive  # about 6 s
def test_sigusr1_to_the_study_waits_for_the_step_in_flight_however_long(tmp_path, monkeypatch, capsys):
    """SIGUSR1 to the study (no time limit to keep) waits for each run to checkpoint, however
    long its step in flight: here 4 s, beyond the time limit's lead (made 1 s). Fails on the old
    code, which waited the time limit's lead (2 × the slowest recent step + 15 s, 45 s at least)
    and then stopped the run and, not resumed from a checkpoint, removed it: a CPU step that
    slowed to more than twice its recent time beside other work lost the run."""
    import argparse
    import threading

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch, Runner

    run_dir = tmp_path / "slow"
    launch = Launch(run_dir, [sys.executable, "-c", LONG_STEP_AT_PAUSE_RANK, "-m", "vrgd_ds.train", str(run_dir)], {},
                    {"corpus": "c", "batch": 8, "optimizer": "slow", "seed": 1, "lr": 1e-3, "factor": 1.0,
                     "steps": 10, "samples": 80}, tmp_path / "no-data")
    monkeypatch.setattr(Runner, "lead", lambda self, launches, active: 1.0)
    args = argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=29900)
    log = run_dir / "log.txt"
    asker = threading.Thread(target=lambda: (wait_until(lambda: log.is_file() and "step 1 done" in log.read_text(),
                                                        str(log)), setattr(args, "pause_requested", True)))
    asker.start()
    (result,) = Runner(args).run([launch])
    asker.join()
    assert result is None and (run_dir / PAUSED).is_file(), capsys.readouterr().out
    assert [g["step"] for g in launch.segments()] == [1]
    assert f"SIGUSR1: {run_dir} paused (checkpoint kept" in capsys.readouterr().out


#: a stand-in for one rank in its start-up: SIGUSR1 not handled yet (its default action ends it)
STARTING_RANK = """
import time
print("starting", flush=True)
while True:
    time.sleep(1)
"""


def test_a_resumed_run_paused_in_its_start_up_is_kept_at_the_checkpoint_it_resumed_from(tmp_path, capsys):
    """A pause (SIGUSR1 to the study, or the time limit) that reaches a resumed run before its job
    handles SIGUSR1 ends the rank without a new checkpoint. The checkpoint it resumed from still
    stands: the run is kept as paused at its last segment's step, its ``PAUSED`` file as it was,
    and the next start resumes it; a run not resumed is removed as before. Fails on the code
    before, which removed the resumed run's directory with its checkpoint (a 16× CPU run at step
    68 of 128, paused seconds after it was resumed, lost so)."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch, Runner

    def launch(name: str) -> Launch:
        run_dir = tmp_path / name
        return Launch(run_dir, [sys.executable, "-c", STARTING_RANK, "-m", "vrgd_ds.train", str(run_dir)], {},
                      {"corpus": "c", "batch": 8, "optimizer": name, "seed": 1, "lr": 1e-3, "factor": 1.0,
                       "steps": 10, "samples": 80}, tmp_path / "no-data")

    resumed, fresh = launch("resumed"), launch("fresh")
    segments = [{"machine": "m", "wall_s": 30.0, "step": 6, "samples": 48.0}]
    resumed.run_dir.mkdir()
    (resumed.run_dir / PAUSED).write_text(json.dumps(segments))
    (resumed.run_dir / "study_config.json").write_text(json.dumps(resumed.config))
    (resumed.run_dir / "checkpoints").mkdir()
    runner = Runner(argparse.Namespace(parallel=2, time_limit=600, started=time.monotonic(), ranks=1, port=None))
    active = {slot: (slot, *runner.start(one, slot)) for slot, one in enumerate((resumed, fresh))}
    try:
        wait_until(lambda: all("starting" in (one.run_dir / "log.txt").read_text() for one in (resumed, fresh)),
                   "both stand-ins started")
        assert runner.pause([resumed, fresh], active, 5.0, "SIGUSR1") == [0]
        assert active[0][1].poll() == -signal.SIGUSR1  # ended by the signal, no checkpoint since
        assert resumed.segments() == segments and (resumed.run_dir / "checkpoints").is_dir()
        assert [(g["paused"], g["step"]) for g in runner.stopped] == [(True, 6), (False, 0)]
        out = capsys.readouterr().out
        assert f"SIGUSR1: {resumed.run_dir} stopped before it checkpointed again, kept at its last checkpoint" in out
        assert f"SIGUSR1: {fresh.run_dir} stopped, removed" in out
        proc, _, log = runner.start(resumed, 0)  # the next start resumes it
        proc.kill()
        proc.wait()
        log.close()
        assert f"resuming {resumed.run_dir} from step 6" in capsys.readouterr().out
    finally:
        for _, proc, _, log in active.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def test_expect_rate_is_the_machines_shared_by_the_runs_in_flight(tmp_path):
    """``--expect-rate`` × ``--expect-share`` (by default ``--parallel``) is the machine's rate,
    which the runs in flight share: before any run has finished, a run starts only while the time
    left holds it and what the runs beside it still have to train. A 64× run (6.5M samples) fits
    a call of 420 s alone at 8 × 4,000 samples/s (an H200's rate with 8 runs side by side), not
    beside six 16× runs with 1.6M samples each to go (on an H200 two 64× runs started beside six
    16× runs took a share of the GPU from them). Fails on the rule that held each run to the rate
    of one among 8, which never started a 64× run in a call (6.5M / 4,000 = 1,630 s) however few
    ran beside it, so that no lease could run the study's 64× cells. Finished runs' rates, times
    the runs beside them, replace it. Without a rate every run fits until one finishes."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    def launch(name: str, samples: int, trained: int | None = None) -> Launch:
        run = Launch(tmp_path / name, [], {}, {"samples": samples}, tmp_path / "no-data")
        if trained is not None:  # in flight: its steps logged so far
            run.run_dir.mkdir()
            (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "train/samples": trained,
                                                                   "time": time.time()}) + "\n")
        return run

    args = argparse.Namespace(parallel=8, time_limit=Runner.ASSEMBLY_S + Runner.PAUSE_S + 420,
                              started=time.monotonic(), ranks=1, port=29900)
    assert Runner(args).fits(launch("a", 6_520_832))  # no rate known: it starts
    args.expect_rate = 4000.0
    runner = Runner(args)
    assert runner.aggregate_rate() == 32_000.0
    sixteens = [launch(f"s{k}", 1_630_208, trained=0) for k in range(6)]
    assert runner.fits(launch("alone", 6_520_832))  # 204 s of the machine
    assert runner.fits(launch("two", 6_520_832), [launch("first", 6_520_832)])  # 408 s
    assert not runner.fits(launch("three", 6_520_832), [launch("f1", 6_520_832), launch("f2", 6_520_832)])
    assert not runner.fits(launch("b", 6_520_832), sixteens)  # 510 s
    assert runner.fits(launch("c", 1_630_208), sixteens)  # a seventh 16×: 357 s
    done = [launch(f"d{k}", 1_630_208, trained=1_500_000) for k in range(6)]  # nearly done: 130,208 each to go
    assert runner.fits(launch("e", 6_520_832), done)
    args.expect_share = 1  # measured alone: the machine's rate is one run's
    assert Runner(args).aggregate_rate() == 4000.0 and not Runner(args).fits(launch("f", 6_520_832))
    runner.rates.append(20_000.0)  # a run finished showing this rate: it decides now
    assert runner.aggregate_rate() == 20_000.0 and runner.fits(launch("g", 6_520_832))


@pytest.mark.slow
@pytest.mark.exhaustive  # three real runs of 24 steps (about 2 minutes): make test-all
def test_a_run_the_time_limit_pauses_resumes_to_the_uninterrupted_runs_loss(tmp_path):
    """At the time limit the runner pauses a real run (SIGUSR1 to its rank, not to the DeepSpeed
    launcher's processes, which do not handle it; the DataLoader worker is left alone): the job
    checkpoints and exits, its directory is kept with the segment, and the next start of the same
    run resumes it. The resumed run logs each step once, its record sums both segments' time, and
    its held-out loss is the uninterrupted run's exactly, so a record may hold runs that went on
    across calls, leases or sessions."""
    import argparse
    import time

    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Runner, plan_run, prepare

    data = prepare("embedded", None, tmp_path / "data", 64, 2000)

    def args_for(work: Path) -> argparse.Namespace:
        return argparse.Namespace(work=work, samples=16 * 24, min_steps=24, seq_len=64, ranks=1, workers=1,
                                  micro_batch=8, groups=None, base_lr=4e-3, base_batch=64, lr_rule="sqrt",
                                  model="tiny", port=29693, parallel=1, started=time.monotonic(), time_limit=None)

    args = args_for(tmp_path / "paused")
    launch = plan_run("VR-LAMB first_moment", "embedded", data, 16, 1.0, 1, args)
    runner = Runner(args)
    proc, t0, log = runner.start(launch, 0)
    metrics, deadline = launch.run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count('"train/samples"') >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, (launch.run_dir / "log.txt").read_text()[-3000:]
        time.sleep(0.2)
    assert runner.pause([launch], {0: (0, proc, t0, log)}, Runner.PAUSE_S) == [0]
    assert proc.returncode == 75 and (launch.run_dir / "checkpoints").is_dir()
    (segment,) = launch.segments()
    assert 3 <= segment["step"] < 24 and args.stopped[0]["paused"] is True
    assert launch.samples_left() == 16 * (24 - segment["step"])

    (resumed,) = Runner(args).run([launch])
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train/samples"' in line]
    assert steps == list(range(1, 25))  # each step once: the resume went on from the checkpoint
    assert [g["step"] for g in resumed["segments"]] == [segment["step"], 24]
    assert resumed["wall_s"] == round(sum(g["wall_s"] for g in resumed["segments"]), 1)
    assert not (launch.run_dir / PAUSED).exists()

    other = args_for(tmp_path / "uninterrupted")
    (whole,) = Runner(other).run([plan_run("VR-LAMB first_moment", "embedded", data, 16, 1.0, 1, other)])
    assert "segments" not in whole and resumed["mlm_loss"] == whole["mlm_loss"]
    assert 0.0 < resumed["data_wait"] < 1.0 and 0.0 < whole["data_wait"] < 1.0  # the job logs its data time


@pytest.mark.exhaustive  # two interpreter starts importing the package (3-7 s): make test-all
def test_the_suites_release_check_runs_on_an_interpreter_with_packages_on_pythonpath(tmp_path):
    """The GPU suite checks the sentencepiece release before its studies, in the layout of a GPU
    image: packages on PYTHONPATH, the project laid out by ``benchmarks/source_tree.sh`` and not
    installed (here: this virtual environment's base interpreter, its packages on PYTHONPATH after
    the laid-out checkout). ``benchmarks/pinned_release.py`` passes there. Fails on the code before:
    the suite read the check from stdin in the checkout, where the working directory comes first on
    sys.path and the checkout's ``vrgd_ds/``, which has no ``data_pipeline/``, shadows the laid-out
    tree (``ModuleNotFoundError: No module named 'vrgd_ds.data_pipeline'``, as on an H200 lease,
    which then started no study); the same check read from stdin fails here too."""
    import os
    import sysconfig

    base = Path(sys.base_prefix) / "bin" / "python3"
    if sys.prefix == sys.base_prefix or not base.is_file():
        pytest.skip("needs a virtual environment and its base interpreter")
    tree = subprocess.run(["bash", str(ROOT / "benchmarks" / "source_tree.sh"), str(tmp_path / "src")],
                          capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(ROOT), sysconfig.get_paths()["purelib"]]))
    script = ROOT / "benchmarks" / "pinned_release.py"
    proc = subprocess.run([str(base), str(script.relative_to(ROOT))], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    old = subprocess.run([str(base), "-"], input=script.read_text(), cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert old.returncode != 0 and "No module named 'vrgd_ds.data_pipeline'" in old.stderr


@pytest.mark.slow
@pytest.mark.exhaustive  # one real run of 4 steps (30 s): make test-all
def test_bert_batch_runs_from_a_checkout_on_an_interpreter_with_packages_on_pythonpath(tmp_path):
    """The GPU suite's layout: DeepSpeed and the rest installed with ``pip --target`` and put on
    PYTHONPATH (no ``deepspeed`` script beside the interpreter), the project not installed but
    laid out by ``benchmarks/source_tree.sh`` (``vrgd_ds.data_pipeline`` is the top-level
    ``data_pipeline/``). Here: the base interpreter of this virtual environment, with the
    environment's packages on PYTHONPATH after the laid-out checkout. Fails on the code before in
    two ways: the study started ``<interpreter's folder>/deepspeed`` (FileNotFoundError; now
    ``-m deepspeed.launcher.runner``), and the suite put only the checkout on PYTHONPATH, where
    ``vrgd_ds.data_pipeline`` does not import."""
    import os
    import sysconfig

    base = Path(sys.base_prefix) / "bin" / "python3"
    if sys.prefix == sys.base_prefix or not base.is_file() or (base.parent / "deepspeed").exists():
        pytest.skip("needs a virtual environment whose base interpreter has no deepspeed script")
    tree = subprocess.run(["bash", str(ROOT / "benchmarks" / "source_tree.sh"), str(tmp_path / "src")],
                          capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(ROOT), sysconfig.get_paths()["purelib"]]))
    proc = subprocess.run([str(base), str(STUDIES / "bert_batch.py"), "--corpus", "embedded", "--batch", "16",
                           "--optimizer", "LAMB", "--lr-factor", "1", "--seed", "1", "--samples", "64", "--min-steps",
                           "1", "--vocab-size", "2000", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                           "--port", "29685"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = [json.loads(line) for line in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    assert run["steps"] == 4 and math.isfinite(run["mlm_loss"])


@pytest.mark.slow
@pytest.mark.exhaustive  # the real job twice per optimizer (1 min): make test-all
def test_bert_batch_quick_at_noise_multiples(tmp_path, study_work):
    """``--noise-multiple`` through the real job: batches at 1× and 4× a given B_simple of 16, the
    unigram level of the prepared corpus's held-out masks computed and named in the verdict table
    (between a trained model's and the uniform distribution's), each run's data fingerprint
    recorded, and every cell of one seed left undecided."""
    run_study("bert_batch.py", "--quick", "--noise-multiple", "1", "--noise-multiple", "4", "--noise-scale", "16",
              "--groups", "2", "--parallel", "2", "--work", str(study_work), "--out", str(tmp_path / "out"),
              "--port", "29683", timeout=900)
    runs = check_output(tmp_path / "out", ["bert_batch.png"])
    assert sorted({r["batch"] for r in runs}) == [16, 64] and {r["groups"] for r in runs} == {2}
    assert not any(Path(r["run_dir"]).is_absolute() for r in runs)  # under --work: no scratch path recorded
    for r in runs:  # --groups 2: two micro-batches of batch / 2, at every batch
        phase = json.loads((study_work / "quick" / r["run_dir"] / "study_config.json").read_text())["job"]["phases"][0]
        assert phase["micro_batch"] * 2 == phase["global_batch"] == r["batch"]
    assert len({r["data"] for r in runs}) == 1 and all(len(r["data"]) == 16 for r in runs)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert 3.0 < meta["unigram_loss"]["embedded"] < math.log(2000)
    tables = (tmp_path / "out" / "tables.md").read_text()
    assert f"unigram level, nats: embedded {meta['unigram_loss']['embedded']:.3f}" in tables
    assert "not decided: LAMB and VR-LAMB first_moment lack 2 seeds" in tables and meta["unrun"] == []


def test_the_gpu_suites_study_commands_parse():
    """Every ``studies/bert_batch.py`` command of ``benchmarks/gpu_suite.sh`` (the seed check and
    the study past the plateau), its shell variables at their defaults, is one the study's parser
    takes: an option it lacks would end a lent GPU's call at once, with the lease's time spent."""
    import re
    import shlex

    sys.path.insert(0, str(STUDIES))
    from bert_batch import parser

    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text().replace("\\\n", " ")
    commands = [line.split("studies/bert_batch.py", 1)[1] for line in script.splitlines()
                if "python3 studies/bert_batch.py" in line and not line.lstrip().startswith("#")]
    assert len(commands) == 2
    for command in commands:
        command = command.replace('"${reuse[@]}"', "--reuse docs/studies/bert_plateau")
        command = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", command)  # ${NAME:-default}
        command = re.sub(r"\$\(\([^)]*\)\)", "100", command)  # $((arithmetic))
        command = re.sub(r"\$[a-zA-Z_]+", "/x", command)  # $wikitext, $WORK
        args = parser().parse_args(shlex.split(command))
        assert args.time_limit is None or args.expect_share == 8


def test_the_gpu_suite_refuses_a_part_it_does_not_have(tmp_path):
    """A misspelt name in ``PARTS`` (``zero2-seq128``) matched no part: the call ran nothing, said
    "done" and spent the lease. It now exits 2 at once naming the parts, and every part the script
    runs is among them. Fails on the old script."""
    import re

    script = ROOT / "benchmarks" / "gpu_suite.sh"
    res = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PARTS": "plateau zero2-seq128"})
    assert res.returncode == 2 and "unknown part 'zero2-seq128' in PARTS" in res.stderr, res.stderr
    known = set(res.stderr.split("the parts:", 1)[1].split())
    text = script.read_text().replace("\\\n", " ")
    ran = set(re.findall(r"^\s*part (\w+) ", text, re.M)) | set(re.findall(r"^\s*zero2 (\w+) ", text, re.M))
    assert ran | {"plateau"} == known, (ran, known)


def _paused_launch(tmp_path: Path, name: str, cmd: list[str], config: dict, paused: bool = True):
    """A ``Launch`` whose directory holds a pause (a ``PAUSED`` segment at step 120, its config, a
    checkpoint), as a time limit left it; with ``paused`` False a run never started."""
    sys.path.insert(0, str(STUDIES))
    from bert_batch import PAUSED, Launch

    one = Launch(tmp_path / name, cmd, config, {"corpus": "c", "batch": 8, "optimizer": name, "seed": 1, "lr": 1e-3,
                                                "factor": 1.0, "steps": 128, "samples": 1024}, tmp_path / "no-data")
    if not paused:
        return one
    one.run_dir.mkdir(parents=True)
    (one.run_dir / PAUSED).write_text(json.dumps([{"machine": "m", "wall_s": 300.0, "step": 120, "samples": 960.0}]))
    (one.run_dir / "study_config.json").write_text(json.dumps(config))
    (one.run_dir / "checkpoints").mkdir()
    return one


def test_a_paused_run_resumes_with_other_dataloader_workers():
    """A run paused with ``--workers 4`` is started again with 7 (the GPU suite's default since):
    the workers do not change its result (``UNCHANGING``), so it resumes from its checkpoint.
    Fails on the code before, which compared the whole config and started it again from step 0,
    deleting its checkpoint and segments."""
    import argparse
    import tempfile

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner, base_config

    with tempfile.TemporaryDirectory() as tmp:
        one = _paused_launch(Path(tmp), "run", [sys.executable, "-c", "pass"], base_config(64, 8, 1, 4))
        one.config = base_config(64, 8, 1, 7)
        runner = Runner(argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=None))
        proc, _, log = runner.start(one, 0)
        proc.wait()
        log.close()
        assert [g["step"] for g in one.segments()] == [120] and (one.run_dir / "checkpoints").is_dir()


def test_a_failed_run_leaves_a_resumed_runs_checkpoint_and_its_rate_is_not_the_machines(tmp_path, capsys):
    """A run fails while a run resumed from a pause is in flight: the failure is recorded with its
    log's end, printed, and the other run goes on to its end. Before, the study stopped at once,
    killed the other run and removed its directory (a resumed run's checkpoint and segments with
    it), and said only where the failed run's log was, a file a lent GPU machine does not return
    (fails on the old code). And a resumed run that finishes gives no machine rate: its segment is
    mostly start-up (before: a 16× run's last 8 steps set the rate to 13,147 samples/s against
    32,000, and a 64× run that fitted was refused)."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Runner

    finish = ("import json, time; time.sleep(3); open('metrics.jsonl', 'a').write(json.dumps({'step': 128, 'time': "
              "time.time(), 'train/samples': 1024.0, 'eval/mlm_loss': 6.5, 'eval/mlm_acc': 0.1}) + '\\n')")
    resumed = _paused_launch(tmp_path, "resumed", [sys.executable, "-c", finish], {"cfg": 1})
    failing = _paused_launch(tmp_path, "failing", [sys.executable, "-c", "import sys; print('CUDA error: no kernel "
                                                   "image'); sys.exit(1)"], {"cfg": 2}, paused=False)
    args = argparse.Namespace(parallel=2, time_limit=None, started=time.monotonic(), ranks=1, port=None)
    results = Runner(args).run([resumed, failing])
    assert results[0]["mlm_loss"] == 6.5 and results[1] is None
    assert [(f["run"], f["returncode"]) for f in args.failed] == [(str(failing.run_dir), 1)]
    assert any("CUDA error: no kernel image" in line for line in args.failed[0]["log_tail"])
    assert "    | CUDA error: no kernel image" in capsys.readouterr().out
    last_step = ("import json, time; open('metrics.jsonl', 'a').write(json.dumps({'step': 128, 'time': time.time(), "
                 "'train/samples': 1024.0, 'eval/mlm_loss': 6.0, 'eval/mlm_acc': 0.1}) + '\\n')")
    quick = _paused_launch(tmp_path, "quick", [sys.executable, "-c", last_step], {"cfg": 3})
    runner = Runner(argparse.Namespace(parallel=1, time_limit=None, started=time.monotonic(), ranks=1, port=None))
    assert runner.run([quick])[0]["mlm_loss"] == 6.0
    assert runner.rates == []


#: a stand-in rank whose steps take 60 s by its log (so the pause is signalled well before the limit),
#: checkpointing at once on SIGUSR1
SLOW_STEP_RANK = r"""
import json, os, signal, sys, time
run_dir = sys.argv[3]
def on_usr1(*_):
    open(run_dir + "/requeue.json", "w").write("{}")
    os._exit(75)
signal.signal(signal.SIGUSR1, on_usr1)
now = time.time()
with open(run_dir + "/metrics.jsonl", "w") as fh:
    for k, t in enumerate((now, now + 1, now + 61)):
        fh.write(json.dumps({"step": k + 1, "time": t, "train/samples": 8.0 * (k + 1)}) + "\n")
while True:
    time.sleep(0.2)
"""


def test_a_pause_signalled_early_for_slow_steps_ends_the_studys_starts(tmp_path):
    """Steps of 60 s put the time-limit pause 90 s before the limit; the run checkpoints at once, so
    the Runner returns well before it. No run starts after that pause: later rounds assemble from
    what finished. Fails on the code before, which looked only at the clock against the limit and
    let the next bracket round or corpus start runs that were then paused in their start-up."""
    import argparse

    sys.path.insert(0, str(STUDIES))
    from bert_batch import Launch, Runner

    slow = Launch(tmp_path / "slow", [sys.executable, "-c", SLOW_STEP_RANK, "-m", "vrgd_ds.train",
                                      str(tmp_path / "slow")], {},
                  {"corpus": "c", "batch": 8, "optimizer": "slow", "seed": 1, "lr": 1e-3, "factor": 1.0, "steps": 10,
                   "samples": 80}, tmp_path / "no-data")
    args = argparse.Namespace(parallel=1, time_limit=Runner.ASSEMBLY_S + Runner.PAUSE_S + 93,
                              started=time.monotonic(), ranks=1, port=None)
    Runner(args).run([slow])
    assert args.started + 60 > time.monotonic()  # returned long before the limit
    assert [g["paused"] for g in args.stopped] == [True] and args.only_finished is True


@pytest.mark.exhaustive  # about 9 s (make test: the record's reuse, test_adaptive_batch_reuses_only_a_record_with_its_settings)
def test_out_among_reuse_keeps_the_records_runs_the_study_does_not_use(tmp_path):
    """``--out`` naming a ``--reuse`` directory (the way the plateau record is assembled): the
    record's runs this invocation does not write again (a 10-step run, an optimizer it was not
    asked for) stay in it. Fails on the code before, which unlinked the record's runs.jsonl and
    wrote back only this invocation's cells."""
    import platform

    cfg = {"corpora": ["embedded"], "samples": 10240, "min_steps": 50, "seq_len": 64, "micro_batch": 8, "groups": None,
           "ranks": 1, "lr_rule": "sqrt", "base_lr": 0.004, "base_batch": 64, "vocab_size": 8000, "model": "tiny",
           "zero": 2, "quick": False, "heldout_fraction": None, "eval_points": None, "dropout": None}
    record = tmp_path / "record"
    record.mkdir()
    (record / "meta.json").write_text(json.dumps({"config": cfg, "started": "x", "machine": {
        "python": platform.python_version(), "processor": "x86_64", "cpus": 2, "commit": None}}))

    def run(batch, steps, label, seed):
        return {"corpus": "embedded", "batch": batch, "optimizer": label, "factor": 1.0, "seed": seed, "steps": steps,
                "samples": steps * batch, "groups": batch // 8, "lr": 0.004, "mlm_loss": 6.0 + seed / 100,
                "mlm_acc": 0.1, "wall_s": 1.0, "b_simple": None}

    runs = [run(64, 160, "LAMB", s) for s in (1, 2)] + [run(1024, 10, "LAMB", 1), run(64, 160, "VR-LAMB update", 1)]
    (record / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    subprocess.run([sys.executable, str(STUDIES / "bert_batch.py"), "--only-finished", "--batch", "64", "--batch", "1024",
                    "--optimizer", "LAMB", "--lr-factor", "1", "--work", str(tmp_path / "work"), "--reuse", str(record),
                    "--out", str(record)], check=True, capture_output=True, cwd=ROOT)
    after = [json.loads(line) for line in (record / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["batch"], r["steps"], r["optimizer"], r["seed"]) for r in after) == sorted(
        (r["batch"], r["steps"], r["optimizer"], r["seed"]) for r in runs)


def test_probe_only_probes_every_corpus(tmp_path, monkeypatch):
    """``--probe-only`` with two corpora: each is prepared and probed (its runs stood in for here),
    and each gets its noise scale. Fails on the code before, which after the first corpus's probe
    set the study to assemble only, so the second was neither prepared nor probed."""
    sys.path.insert(0, str(STUDIES))
    import bert_batch as bb

    prepared, probed = [], []

    def fake_prepare(name, source, out, seq_len, vocab):
        prepared.append(name)
        (out / "data" / name).mkdir(parents=True, exist_ok=True)
        return out / "data" / name

    def fake_run_all(cells, args, record):
        if args.only_finished:
            return []
        done = []
        for label, corpus, data, batch, factor, seed in cells:
            probed.append(corpus)
            done.append({"corpus": corpus, "batch": batch, "optimizer": label, "factor": factor, "seed": seed,
                         "steps": 160, "samples": 10240, "groups": 8, "lr": 4e-3, "mlm_loss": 6.0, "mlm_acc": 0.1,
                         "wall_s": 1.0, "b_simple": None if label == "LAMB" else 100.0})
            record(done[-1])
        return done

    monkeypatch.setattr(bb, "prepare", fake_prepare)
    monkeypatch.setattr(bb, "run_all", fake_run_all)
    monkeypatch.setattr(sys, "argv", ["bert_batch.py", "--probe-only", "--noise-multiple", "1", "--noise-multiple", "4",
                                      "--corpus", "a=/nonexistent/a", "--corpus", "b=/nonexistent/b", "--optimizer",
                                      "LAMB", "--optimizer", "VR-LAMB first_moment", "--lr-factor", "1", "--work",
                                      str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    bb.main()
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert prepared == ["a", "b"] and sorted(set(probed)) == ["a", "b"]
    assert meta["noise_scale"] == {"a": 100.0, "b": 100.0}


@pytest.mark.exhaustive  # about 3 s (make test: the page from the committed records)
def test_collapse_tables_from_takes_each_runs_lr_from_the_record(tmp_path, monkeypatch):
    """``collapse.py --tables-from`` labels each best LR with the LR its runs.jsonl row ran at, not
    with the base LR the code's OPTIMIZERS table gives today: with every base LR changed and a
    label removed from the code, the committed record still gives its tables.md byte for byte.
    Before, ``summarise()`` took base LRs from OPTIMIZERS: the changed ones relabelled old runs and
    the removed label raised KeyError (fails on the old code)."""
    import shutil

    sys.path.insert(0, str(STUDIES))
    import collapse
    import common

    changed = {lb: (base * 10, make) for lb, (base, make) in collapse.OPTIMIZERS.items() if lb != "LAMB"}
    monkeypatch.setattr(collapse, "OPTIMIZERS", changed)
    monkeypatch.setattr(sys, "argv", ["collapse.py", "--tables-from", "copy"])
    monkeypatch.setattr(common, "machine", lambda: {"commit": None})  # not its imports: seconds
    record = ROOT / "docs" / "studies" / "collapse"
    copy = tmp_path / "collapse"
    shutil.copytree(record, copy)
    collapse.rebuild(copy)
    assert (copy / "tables.md").read_text() == (record / "tables.md").read_text()


def test_linreg_counts_a_run_whose_optimizer_skipped_steps_as_diverged():
    """``studies/linreg.py``: VR-SGD at LR 1 (k = 64) blows up, and its optimizer then skips every
    step for non-finite statistics, so the weights stay put and the loss plateaus near 6e36, finite.
    Such a run now counts as diverged (its losses inf from the first skipped step), and where every
    LR of the grid diverged ``tuned`` names no best LR. Before, the plateau passed for a final loss
    and a grid of diverging LRs named its first LR best (fails on the old code)."""
    sys.path.insert(0, str(STUDIES))
    import linreg

    problem = dict(k=64, gamma=0.1, sigma=0.0, features="uniform", steps=40, batch=2048)
    diverging = linreg.run("VR-SGD", 1.0, 0, **problem)["losses"]
    assert len(diverging) == 41 and diverging[-1] == math.inf and math.isfinite(diverging[1])
    assert math.isfinite(linreg.run("VR-SGD", 0.35, 0, **problem)["losses"][-1])

    class Record:
        def log_run(self, record):
            pass

    lr, runs = linreg.tuned("VR-SGD", [1.0], [0], Record(), {}, **problem)
    assert lr is None and runs[0]["losses"][-1] == math.inf


def test_linreg_gsnr_plot_counts_steps_from_one(tmp_path, monkeypatch):
    """``studies/linreg.py``'s GSNR plot puts the GSNR of step t's gradients at x = t, t from 1, as
    the GSNR table's "step" column calls it. Before, the plot's x axis counted from 0: every
    point one step left of the table's (fails on the old code)."""
    sys.path.insert(0, str(STUDIES))
    import common
    import linreg

    figs = {}
    monkeypatch.setattr(common.Output, "savefig", lambda self, fig, name: figs.setdefault(name, fig))
    monkeypatch.setattr(common, "machine", lambda: {"commit": None})  # not its imports: seconds
    monkeypatch.setattr(sys, "argv", ["linreg.py", "--quick", "--steps", "4", "--batch", "64", "--label-noise", "0",
                                      "--out", str(tmp_path)])
    quiet = logging.getLogger("vrgd_ds")  # the study quiets the package's warnings: restored after it
    before = quiet.level
    try:
        linreg.main()
    finally:
        quiet.setLevel(before)  # (setLevel, not the attribute: it clears the loggers' cached levels too)
    lines = figs["gsnr.png"].axes[0].get_lines()
    assert len(lines) == linreg.DIM and all(list(line.get_xdata()) == [1, 2, 3, 4] for line in lines)
    common.plt().close("all")


def test_bf16_moments_refuses_an_at_with_no_step_before_training(tmp_path, monkeypatch, capsys):
    """``studies/bf16_moments.py --steps 1``: the default ``--at 2 10 20 40`` has no step within
    it, so nothing would be compared; the study now says so, naming --at and --steps, before it
    trains. Before, it trained, then ``write()`` failed with ``max() arg is an empty sequence``
    (fails on the old code: it reaches the training here)."""
    sys.path.insert(0, str(STUDIES))
    import bf16_moments

    def train(args):
        raise AssertionError("trained")

    monkeypatch.setattr(bf16_moments, "run", train)
    with pytest.raises(SystemExit) as stop:
        bf16_moments.main(["--steps", "1", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--at 2 10 20 40" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("study", ["collapse", "linreg"])
def test_studies_refuse_zero_seeds_at_parsing(study, tmp_path, monkeypatch, capsys):
    """``--seeds 0`` (``studies/collapse.py``, ``studies/linreg.py``) is refused as the arguments
    are parsed, naming --seeds. Before, the study ran a grid of no runs and failed in
    ``statistics.mean([])`` (fails on the old code)."""
    sys.path.insert(0, str(STUDIES))
    module = __import__(study)
    monkeypatch.setattr(sys, "argv", [f"{study}.py", "--seeds", "0", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 2 and "--seeds" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
