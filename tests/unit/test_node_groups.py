"""The hierarchical scheme's node groups (vrgd_ds/stats/hierarchical.py ``node_groups``) in one
process of a 1-rank gloo world: made once per world and node size, made again once destroyed; and
``vrgd_ds.run`` leaving such a world when its script exits."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from vrgd_ds.stats import hierarchical
from vrgd_ds.stats.hierarchical import node_groups


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    made = getattr(hierarchical, "_NODES", {})  # the groups an earlier test's world made are gone with it
    made.clear()
    try:
        yield
    finally:
        made.clear()
        dist.destroy_process_group()


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_a_second_attach_reuses_the_node_groups(one_rank):
    """A second attach in the process (a second engine, a Trainer's second ``train()``) reuses the
    two groups of the first. Fails on the code that made two new groups at every attach, each with
    the backend's threads (3 a group on gloo) and, on NCCL, its communicators, never freed."""
    before = _groups()
    first = node_groups(dist, 1, 0, 1)
    assert _groups() == before + 2
    for _ in range(3):
        assert node_groups(dist, 1, 0, 1) is first
    assert _groups() == before + 2


def test_destroyed_node_groups_are_made_again(one_rank):
    """Groups destroyed since (``destroy_process_group`` of each, as a test harness or a restart in
    the process does) are not handed out again: the next attach makes new ones, which reduce."""
    first = node_groups(dist, 1, 0, 1)
    dist.destroy_process_group(first.intra)
    dist.destroy_process_group(first.cross)
    again = node_groups(dist, 1, 0, 1)
    assert again is not first
    for group in (again.intra, again.cross):
        t = torch.ones(3)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_script_that_ends_with_sys_exit_0_leaves_the_process_group_through_vrgd_ds_run(tmp_path, monkeypatch):
    """``python -m vrgd_ds.run script.py`` whose script ends with ``sys.exit(main())``: every rank
    leaves the process group together (``run.leave_together``), as for a script that returns.
    Fails on the code before, where the script's SystemExit(0) went past it, leaving the group
    to gloo's teardown (whose abort can replace the exit code)."""
    from vrgd_ds import run

    script = tmp_path / "train.py"
    script.write_text("import sys\nimport torch.distributed as dist\n"
                      f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, "
                      "world_size=1)\nsys.exit(0)\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        with pytest.raises(SystemExit) as ended:
            run.main([str(script)])
        assert ended.value.code == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("ranks, message", [
    # host B's 4 ranks were split into two "nodes" of 2 (the size was host A's count)
    ([("A", None), ("A", None), ("B", None), ("B", None), ("B", None), ("B", None)],
     "the hosts hold unequally many ranks (A: 2, B: 4)"),
    # torchrun's LOCAL_WORLD_SIZE disagreeing on host B only: every rank must raise, not B's alone
    ([("A", ("LOCAL_WORLD_SIZE", "2")), ("A", ("LOCAL_WORLD_SIZE", "2")), ("B", ("LOCAL_WORLD_SIZE", "4")),
      ("B", ("LOCAL_WORLD_SIZE", "4"))], "the launcher's LOCAL_WORLD_SIZE=4 disagrees with the 2 rank(s) found on each host (on B)"),
    # a value that is no number, on one host: read after the gather, so refused on every rank alike
    ([("A", ("LOCAL_WORLD_SIZE", "2")), ("A", ("LOCAL_WORLD_SIZE", "2")), ("B", ("LOCAL_WORLD_SIZE", "")),
      ("B", ("LOCAL_WORLD_SIZE", ""))], "the launcher's LOCAL_WORLD_SIZE= disagrees with the 2 rank(s) found on each host (on B)"),
])
def test_hosts_of_unequally_many_ranks_are_refused_on_every_rank(monkeypatch, ranks, message):
    """``host_node_size`` reads what every rank sees (one gather of each rank's host and launcher
    variable), so every rank raises alike. Fails on the old code: hosts of 2 and 4 ranks passed as
    nodes of 2, and a launcher variable that disagreed on one host raised on that host's ranks
    alone, which left the others in the next collective."""
    for rank in range(len(ranks)):
        def gather(out, obj, group=None):
            out[:] = [(host, local) for host, local in ranks]

        monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
        monkeypatch.setattr("socket.gethostname", lambda rank=rank: ranks[rank][0])
        for name in hierarchical.LOCAL_SIZE_ENV:
            monkeypatch.delenv(name, raising=False)
        if ranks[rank][1] is not None:
            monkeypatch.setenv(ranks[rank][1][0], str(ranks[rank][1][1]))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            hierarchical.host_node_size(None, len(ranks))
