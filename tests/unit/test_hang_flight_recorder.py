"""Flight Recorder import: real dumps, synthetic layouts, damaged files, malicious pickles."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from rankscope.pipeline.cli import main
from rankscope.pipeline.cli.importer import import_flight_recorder, verdict_of
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.importers.flight_recorder import dump_rank_of
from rankscope.pipeline.importers.safe_unpickle import (
    PickleFormatError,
    UnsafePickleError,
    safe_loads,
)
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import read_trace
from support.paths import ROOT

REPO = ROOT
FR_DATA = REPO.parent / "shared" / "data" / "flight-recorder"
REAL_CASES = ["lock_gil_1st", "gpu_error_2nd"]


def culprits(signals) -> dict[str, list[int]]:
    out: dict[str, set[int]] = {}
    for s in signals:
        out.setdefault("unattributed" if s.unattributed else s.kind, set()).update(s.ranks)
    return {k: sorted(v) for k, v in out.items()}


def ground_truth(case_dir: Path) -> list[int]:
    for line in (case_dir / "fault_injection.log").read_text().splitlines():
        if line.startswith("Fault ranks:"):
            return sorted(int(x) for x in line.split(":", 1)[1].strip(" []").split(","))
    raise AssertionError("no 'Fault ranks' line")


# ---- the real cases ----------------------------------------------------------


@pytest.mark.skipif(not FR_DATA.is_dir(), reason=f"real Flight Recorder dumps absent ({FR_DATA})")
@pytest.mark.parametrize("case", REAL_CASES)
def test_real_dumps_name_exactly_the_faulty_ranks(case, tmp_path):
    src = FR_DATA / case
    truth = ground_truth(src)
    assert truth == [9, 14]
    report, records, meta = import_flight_recorder(src, tmp_path / "t")
    assert report.loaded == list(range(16)) and not report.missing and not report.refused
    assert meta["world"] == 16 and meta["source"] == "pytorch-flight-recorder"
    assert culprits(verdict_of(records)) == {"hang": truth}
    # ... and the written trace, replayed by the engine, says the same.
    trace = read_trace(tmp_path / "t")
    assert trace.report.bad == 0
    assert [lab["ranks"] for lab in trace.labels] == [truth]  # from fault_injection.log
    found = replay_trace(tmp_path / "t").findings  # the engine's default hang monitor
    assert [(f.kind, f.ranks, f.action) for f in found] == [("hang", truth, "evict")]
    assert sorted(found[0].hosts) == sorted(f"rank{r}" for r in truth)
    off = Engine(EngineConfig(hang_monitor=False))
    assert replay_trace(tmp_path / "t", engine=off).findings == []


@pytest.mark.skipif(not FR_DATA.is_dir(), reason=f"real Flight Recorder dumps absent ({FR_DATA})")
@pytest.mark.parametrize("case", REAL_CASES)
def test_real_dumps_without_pg_status_still_localize(case, tmp_path):
    # The entries alone must carry the verdict: strip every rank's pg_status.
    d = tmp_path / case
    d.mkdir()
    for f in (FR_DATA / case).iterdir():
        if f.name.startswith("_dump_"):
            obj = safe_loads(f.read_bytes())
            obj.pop("pg_status")
            (d / f.name).write_bytes(pickle.dumps(obj))
    _, records, _ = import_flight_recorder(d, tmp_path / "t")
    assert culprits(verdict_of(records)) == {"hang": [9, 14]}


# ---- synthetic layouts -------------------------------------------------------


class Job:
    """Builds FR-like dumps: groups by name, per-rank counters and pending ops."""

    def __init__(self, world: int, groups: dict[str, list[int]], version: str = "2.9"):
        self.world, self.groups, self.version = world, groups, version
        self.done = {r: {g: 0 for g, m in groups.items() if r in m} for r in range(world)}
        self.pending: dict[int, list[dict]] = {r: [] for r in range(world)}
        self.record = 1000

    def finished(self, rank: int, group: str, seq: int) -> Job:
        self.done[rank][group] = seq
        return self

    def issue(self, rank: int, group: str, seq: int | None = None, op="all_reduce", peer=None):
        """A pending op: collective (seq) or p2p to the global ``peer``."""
        self.record += 1
        members = self.groups[group]
        e = {
            "record_id": self.record,
            "pg_id": self._pg_id(rank, group),
            "process_group": (group, f"GROUP_{group}"),
            "collective_seq_id": seq if peer is None else self.done[rank][group],
            "p2p_seq_id": 0,
            "is_p2p": peer is not None,
            "profiling_name": f"nccl:{op}",
            "state": "scheduled",
            "retired": False,
            "time_created_ns": 1_700_000_000_000_000_000 + self.record * 1000,
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None,
            "input_sizes": [[16]],
            "output_sizes": [[16]],
            "timeout_ms": 60_000,
        }
        if peer is not None:
            me, other = members.index(rank), members.index(peer)
            e["profiling_name"] = (
                f"nccl:{op} {me}->{other}" if op == "send" else (f"nccl:{op} {me}<-{other}")
            )
        self.pending[rank].append(e)
        return self

    def _pg_id(self, rank: int, group: str) -> int:
        mine = sorted((g for g, m in self.groups.items() if rank in m), key=int)
        return mine.index(group)

    def dump(self, rank: int) -> dict:
        mine = sorted((g for g, m in self.groups.items() if rank in m), key=int)
        pg_config = {
            g: {"name": g, "desc": f"GROUP_{g}", "ranks": str(self.groups[g])} for g in mine
        }
        status = {}
        for g in mine:
            seqs = [e["collective_seq_id"] for e in self.pending[rank]
                    if e["process_group"][0] == g and not e["is_p2p"]]  # fmt: skip
            done = self.done[rank][g]
            status[str(mine.index(g))] = {
                "last_enqueued_collective": max(seqs, default=done),
                "last_started_collective": -1,
                "last_completed_collective": done,
            }
        return {
            "version": self.version,
            "pg_config": pg_config,
            "pg_status": status,
            "nccl_version": "2.21.5",
            "entries": list(self.pending[rank]),
        }

    def write(self, d: Path, skip=()) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        for r in range(self.world):
            if r not in skip:
                (d / f"_dump_{r}").write_bytes(pickle.dumps(self.dump(r)))
        return d


def verdict(d: Path, tmp_path: Path, **kw):
    report, records, _ = import_flight_recorder(d, tmp_path / "trace", **kw)
    return report, culprits(verdict_of(records))


def test_single_culprit_in_data_parallel_job(tmp_path):
    job = Job(8, {"0": list(range(8)), "1": list(range(8))})
    for r in range(8):
        job.finished(r, "1", 100)
        if r != 5:
            job.issue(r, "1", 101)
    _, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert v == {"hang": [5]}


def test_culprit_in_a_different_group_is_found_through_the_chain(tmp_path):
    # tp groups 2=[0,1], 3=[2,3]; dp groups 4=[0,2], 5=[1,3]. Rank 3 hangs computing;
    # rank 1 waits in dp for 3; rank 0 waits in tp for 1 (which is stuck in dp).
    job = Job(4, {"0": [0, 1, 2, 3], "2": [0, 1], "3": [2, 3], "4": [0, 2], "5": [1, 3]})
    for r, g, n in [(0, "2", 19), (1, "2", 19), (2, "3", 19), (3, "3", 19)]:
        job.finished(r, g, n)
    for r, g in [(0, "4"), (2, "4"), (1, "5"), (3, "5")]:
        job.finished(r, g, 9)
    job.issue(1, "5", 10).issue(0, "2", 20).issue(2, "3", 20)
    _, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert v == {"hang": [3]}


def test_two_culprits_in_two_groups_at_different_seqs(tmp_path):
    job = Job(8, {"0": list(range(8)), "1": [0, 1, 2, 3], "2": [4, 5, 6, 7]})
    for r in range(4):
        job.finished(r, "1", 70)
    for r in range(4, 8):
        job.finished(r, "2", 300)
    for r in (0, 1, 3):
        job.issue(r, "1", 71)
    for r in (4, 5, 7):
        job.issue(r, "2", 301).issue(r, "2", 302)
    _, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert v == {"hang": [2, 6]}


def test_pipeline_send_waits_for_a_stuck_receiver(tmp_path):
    # pipeline group 7=[0, 2]: rank 0 sends to rank 2, which never posts its recv.
    # 1 sends to 3, whose recv waits behind a tp collective that needs 2.
    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1], "6": [2, 3], "7": [0, 2], "8": [1, 3]})
    job.issue(0, "7", op="send", peer=2)
    job.issue(1, "8", op="send", peer=3)
    job.finished(2, "6", 40).finished(3, "6", 40)
    job.issue(3, "6", 41).issue(3, "8", op="recv", peer=1)
    _, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert v == {"hang": [2]}


def test_stuck_device_rank_whose_peers_finished(tmp_path):
    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})
    for r in range(4):
        job.finished(r, "1", 500 if r != 1 else 497)
    job.issue(1, "1", 498).issue(1, "1", 499).issue(1, "1", 500)
    for r in (0, 2, 3):
        job.issue(r, "1", 501)
    _, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert v == {"hang": [1]}


def waiting_for(culprit: int) -> Job:
    """4 ranks finished group 1's seq 50; all but ``culprit`` entered seq 51."""
    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})
    for r in range(4):
        job.finished(r, "1", 50)
        if r != culprit:
            job.issue(r, "1", 51)
    return job


def test_missing_dump_rank_is_suspect(tmp_path):
    job = waiting_for(2)
    report, v = verdict(job.write(tmp_path / "d", skip=(2,)), tmp_path)
    assert report.missing == [2] and report.world == 4
    assert any("no usable dump for ranks 2" in line for line in report.lines())
    assert v == {"crash": [2]}


def test_truncated_and_foreign_files_are_reported_and_the_rest_used(tmp_path):
    job = waiting_for(1)
    d = job.write(tmp_path / "d")
    data = (d / "_dump_3").read_bytes()
    (d / "_dump_3").write_bytes(data[: len(data) // 2])
    (d / "_dump_2").write_bytes(pickle.dumps({"hello": "world"}))
    (d / "fault_injection.log").write_text("not a dump\n")
    report, v = verdict(d, tmp_path)
    assert set(report.corrupt) == {"_dump_2", "_dump_3"}
    assert "truncated" in report.corrupt["_dump_3"]
    assert report.skipped == ["fault_injection.log"]
    assert report.missing == [2, 3]
    # 0 waits for 1 (alive, outside the collective) and for 2, 3 (no dump).
    assert v == {"hang": [1], "crash": [2, 3]}


def test_older_format_full_ring_buffer_no_pg_status(tmp_path):
    # 2.x before pg_status: entries hold completed ops too, no is_p2p, ranks as a list.
    world, d = 4, tmp_path / "d"
    d.mkdir()
    for r in range(world):
        entries = []
        for seq in range(1, 8 if r != 0 else 7):
            state = "completed" if seq < 7 else "scheduled"
            entries.append({
                "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
                "seq_id": seq, "profiling_name": "nccl:all_reduce", "state": state,
                "time_created_ns": 10**18 + seq,
            })  # fmt: skip
        obj = {"version": "2.1", "pg_config": {"0": {"name": "0", "ranks": list(range(world))}},
               "entries": entries}  # fmt: skip
        (d / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(obj, protocol=2))
    report, v = verdict(d, tmp_path)
    assert report.versions == {"2.1": [0, 1, 2, 3]}
    assert v == {"hang": [0]}


def test_json_dumps_are_read_too(tmp_path):
    import orjson

    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})
    for r in range(4):
        job.finished(r, "1", 9)
        if r != 0:
            job.issue(r, "1", 10)
    d = tmp_path / "d"
    d.mkdir()
    for r in range(4):
        obj = job.dump(r)
        for e in obj["entries"]:
            e["process_group"] = list(e["process_group"])  # JSON has no tuples
        (d / f"rank_{r}.json").write_bytes(orjson.dumps(obj))
    (d / "rank_5.json").write_bytes(b'{"entries": [')
    report, v = verdict(d, tmp_path)
    assert report.loaded == [0, 1, 2, 3] and "bad JSON" in report.corrupt["rank_5.json"]
    assert report.world == 4 and v == {"hang": [0]}


def test_odd_shapes_inside_a_dump_are_noted_not_fatal(tmp_path):
    job = Job(2, {"0": [0, 1]})
    job.finished(0, "0", 3).finished(1, "0", 3).issue(0, "0", 4)
    d = job.write(tmp_path / "d")
    obj = job.dump(1)
    obj["entries"] += ["not an entry", {"state": "scheduled"}]
    obj["pg_status"]["weird"] = {"last_enqueued_collective": "x"}
    obj["pg_config"]["junk"] = 42
    (d / "_dump_1").write_bytes(pickle.dumps(obj))
    report, v = verdict(d, tmp_path)
    assert report.loaded == [0, 1]
    assert any("entry 0 is not a dict" in n for n in report.notes)
    assert any("no process group" in n for n in report.notes)
    assert v == {"hang": [1]}


def test_empty_entry_lists_everywhere_blame_nobody(tmp_path):
    job = Job(4, {"0": [0, 1, 2, 3]})
    report, v = verdict(job.write(tmp_path / "d"), tmp_path)
    assert report.empty == [0, 1, 2, 3]
    assert v == {}


def test_dump_file_names():
    assert dump_rank_of(Path("_dump_12")) == 12
    assert dump_rank_of(Path("nccl_trace_rank_3")) == 3
    assert dump_rank_of(Path("rank-7.pkl")) == 7
    assert dump_rank_of(Path("rank_7.json")) == 7
    assert dump_rank_of(Path("meta.json")) is None
    assert dump_rank_of(Path("fault_injection.log")) is None
    assert dump_rank_of(Path("README")) is None


# ---- malicious pickles -------------------------------------------------------


class _RunsShell:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _CallsEval:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').write('x')",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("payload", [_RunsShell, _CallsEval])
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path, protocol, payload):
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"version": "2.9", "entries": [payload(marker)]}, protocol=protocol)
    with pytest.raises(UnsafePickleError):
        safe_loads(evil)
    assert not marker.exists()
    # In a dump directory: refused, reported, the rank treated as missing.
    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})
    for r in range(4):
        job.finished(r, "1", 9)
        if r != 3:
            job.issue(r, "1", 10)
    d = job.write(tmp_path / "d")
    (d / "_dump_3").write_bytes(evil)
    report, v = verdict(d, tmp_path)
    assert not marker.exists()
    assert list(report.refused) == ["_dump_3"] and "refused global" in report.refused["_dump_3"]
    assert any(line.startswith("  REFUSED _dump_3") for line in report.lines())
    assert v == {"crash": [3]}


def test_safe_loads_plain_data_and_garbage():
    obj = {"a": [1, 2.5, "x", None, True, (3, 4)], "b": {"c": b"raw"}}
    assert safe_loads(pickle.dumps(obj)) == obj
    for bad in (b"", b"\x80\x04", b"not a pickle at all"):
        with pytest.raises(PickleFormatError):
            safe_loads(bad)


# ---- the command -------------------------------------------------------------


def test_cli_import_prints_verdict_and_refuses_misuse(tmp_path, capsys):
    job = Job(4, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})
    for r in range(4):
        job.finished(r, "1", 9)
        if r != 2:
            job.issue(r, "1", 10)
    d = job.write(tmp_path / "d")
    out = tmp_path / "trace"
    assert main(["import", "flight-recorder", str(d), "--out", str(out), "--json"]) == 0
    assert '"hang":[2]' in capsys.readouterr().out
    assert (out / "meta.json").is_file() and (out / "beats.jsonl").is_file()
    assert main(["import", "flight-recorder", str(d), "--out", str(out)]) == 1  # not empty
    assert "--force" in capsys.readouterr().err
    assert main(["import", "flight-recorder", str(tmp_path / "nope"), "--out", str(out)]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["import", "flight-recorder", str(empty), "--out", str(tmp_path / "o2")]) == 1
    assert "no usable flight recorder dump" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["import", "flight-recorder", str(d)])  # --out missing
    assert exc.value.code == 2
    shutil.rmtree(out)
