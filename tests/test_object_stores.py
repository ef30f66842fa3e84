"""Every path through Beam's file systems, against real GCS and S3 servers on this machine
(tests/object_stores.py): the storage layer, atomic publishing (a reader polling during 20
replacements, kill -9 at each step of a publish), and the commands a user runs — train with its
input, output, checkpoints and warm start on the store, predict reading and writing there,
--overwrite — with nothing written to the local working directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from beam_dp import publish, storage

from object_stores import gcs_server, object_store, s3_server  # noqa: F401  (fixtures)

BIN = Path(sys.executable).parent


# ------------------------------------------------------------------------------ the storage layer

def test_bytes_round_trip_list_and_delete(object_store):
    root = object_store.bucket() + "/a"
    storage.write_bytes(root + "/b/x.json", b'{"x": 1}')
    storage.write_bytes(root + "/y.bin", b"\0" * 10)
    assert storage.read_bytes(root + "/b/x.json") == b'{"x": 1}'
    assert storage.exists(root + "/y.bin") and not storage.exists(root + "/z")
    assert storage.list_files(root) == {"b/x.json": 8, "y.bin": 10}
    storage.write_bytes(root + "/y.bin", b"new")   # replaced in one piece
    assert storage.read_bytes(root + "/y.bin") == b"new"
    with pytest.raises(FileNotFoundError, match="z: not found"):
        storage.read_bytes(root + "/z")
    storage.delete_tree(root)
    assert storage.list_files(root) == {}


# -------------------------------------------------------------------------------- publishing

def _version(k: int) -> dict[str, bytes]:
    """A published version whose two files name it (a reader checks they agree)."""
    return {"model.json": json.dumps({"version": k, "pad": "m" * (1000 * k)}).encode(),
            "privacy_report.json": json.dumps({"version": k}).encode()}


def test_publish_replace_and_overwrite_rules(gcs_server):
    """(On the GCS server: the protocol is the storage layer's, and S3 is shown by the CLI
    test below; Beam's S3 file system costs ~0.25 s a call.)"""
    out = gcs_server.bucket() + "/models/day"
    publish.publish(out, _version(1))
    assert publish.read(out) == _version(1)
    assert sorted(storage.list_files(out)) == [publish.MANIFEST, "model.json", "privacy_report.json"]
    with pytest.raises(FileExistsError, match="already exists"):
        publish.publish(out, _version(2))
    publish.publish(out, {"model.json": b"{}"}, overwrite=True)   # a file the new one lacks goes
    assert sorted(storage.list_files(out)) == [publish.MANIFEST, "model.json"]
    # Something beam-dp did not write there: never replaced, even with --overwrite.
    storage.write_bytes(out + "/notes.txt", b"mine")
    with pytest.raises(FileExistsError, match="did not write"):
        publish.publish(out, _version(3), overwrite=True)
    assert storage.read_bytes(out + "/notes.txt") == b"mine"
    # An output inside an output is refused (it would be a foreign entry of the outer one).
    with pytest.raises(FileExistsError, match="is inside"):
        publish.publish(out + "/inner", _version(1))


@pytest.mark.slow
def test_a_reader_polling_during_20_replacements_never_finds_it_missing_or_partial(gcs_server):
    out = gcs_server.bucket() + "/model"
    publish.publish(out, _version(0))
    seen, problems, done = [], [], threading.Event()

    def poll():
        while not done.is_set():
            try:
                files = publish.read(out)
            except Exception as e:   # noqa: BLE001 - any failure is what the test looks for
                problems.append(repr(e))
                continue
            versions = {json.loads(content)["version"] for content in files.values()}
            if len(versions) != 1 or set(files) != {"model.json", "privacy_report.json"}:
                problems.append(f"mixed or partial: {versions}, {sorted(files)}")
            seen.extend(versions)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for k in range(1, 21):
            publish.publish(out, _version(k), overwrite=True)
    finally:
        done.set()
        reader.join()
    assert not problems, problems[:5]
    assert len(set(seen)) > 5 and max(seen) <= 20, sorted(set(seen))   # it did see replacements
    assert publish.read(out) == _version(20)
    assert not [n for n in storage.list_files(out) if n.startswith(publish.STAGING)]


def _publish_and_die(out: str, kill_at: int, files: dict[str, bytes]) -> int:
    """Publishes ``files`` in a forked child that SIGKILLs itself just before its ``kill_at``-th
    storage write (what kill -9 leaves: no handler, no cleanup); returns the child's wait
    status. Forked rather than started: a new interpreter pays Beam's import each time."""
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        try:
            calls = [0]
            real = storage.write_bytes

            def write_bytes(path, content, tmp_dir=None):
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(path, content, tmp_dir)

            storage.write_bytes = write_bytes
            publish.publish(out, files, overwrite=True)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.slow
def test_kill_9_at_each_write_of_a_publish_leaves_the_old_or_the_new_version(gcs_server):
    """A publish of 2 files makes 6 writes (2 staged, the manifest, 2 in place, the manifest):
    killed before each, the output holds version 1 or 2 whole, and a rerun publishes version 2
    and removes the dead run's staging prefix. (On the GCS server: the same publish on S3,
    killed between the manifests, passed too, but costs ~13 s there, Beam's S3 file system
    making a boto3 client per call.)"""
    for kill_at in range(1, 7):
        out = gcs_server.bucket() + "/model"
        publish.publish(out, _version_small(1))
        status = _publish_and_die(out, kill_at, _version_small(2))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (kill_at, status)
        versions = {json.loads(c)["version"] for c in publish.read(out).values()}
        assert versions in ({1}, {2}), (kill_at, versions)
        publish.publish(out, _version_small(2), overwrite=True)   # the rerun
        assert {json.loads(c)["version"] for c in publish.read(out).values()} == {2}
        assert not [n for n in storage.list_files(out) if n.startswith(publish.STAGING)], kill_at


def _version_small(k: int) -> dict[str, bytes]:
    return {"model.json": json.dumps({"version": k}).encode(),
            "privacy_report.json": json.dumps({"version": k}).encode()}


def test_a_dead_first_publish_counts_as_no_output(gcs_server):
    out = gcs_server.bucket() + "/model"
    storage.write_bytes(out + "/" + publish.STAGING + "dead/model.json", b"{}")
    with pytest.raises(ValueError, match="not a complete beam-dp output"):
        publish.read(out)
    publish.publish(out, _version_small(1))   # no --overwrite needed: nothing was published
    assert sorted(storage.list_files(out)) == [publish.MANIFEST, "model.json", "privacy_report.json"]


@pytest.mark.slow
def test_an_input_rewritten_with_the_same_bytes_keeps_its_release_id(object_store):
    """Release ids (beam_dp.ledger.runs) take an object's checksum from its store, not its
    time: a re-upload of the same bytes keeps the run's release, other bytes make a new one."""
    from beam_dp.ledger import runs

    path = object_store.bucket() + "/data/train-0.parquet"
    storage.write_bytes(path, b"the same bytes")
    before = runs.input_snapshot([path])
    assert "checksum" in before[0] and "modified" not in before[0], before
    storage.write_bytes(path, b"the same bytes")
    assert runs.input_snapshot([path]) == before
    storage.write_bytes(path, b"other bytes!!!")
    assert runs.input_snapshot([path]) != before


# ------------------------------------------------------------------------- the user's commands

@pytest.mark.slow
def test_train_predict_warm_start_and_overwrite_on_the_store(object_store, tmp_path, cli,
                                                             monkeypatch):
    """The default command (private count, default flags) on a store: input, output, checkpoints
    and warm start there; predict reads and writes there; nothing lands in the working
    directory; --overwrite replaces the model and a second run without it is refused. On GCS
    the data are made by the beam-dp executable (the store reached from another process); the
    rest runs in-process (the same main, without its start-up each time)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = object_store.bucket()
    make_data = ["make-data", "--output", f"{root}/data", "--n", "400", "--d", "3", "--shards",
                 "2", "--seed", "1", *object_store.flags]
    if object_store.scheme == "gs":   # (S3's flags reach a subprocess the same way: in-process)
        made = subprocess.run([str(BIN / "beam-dp"), *make_data], cwd=cwd,
                              env=object_store.subprocess_env(), capture_output=True, text=True,
                              timeout=300)
        assert made.returncode == 0, made.stderr[-3000:]
    else:
        assert cli(*make_data).code == 0

    def _run(store, cwd, *argv, check=True):
        result = cli(*argv, *store.flags)
        if check:
            assert result.code == 0, result.err[-3000:]
        return result

    inputs = storage.list_files(f"{root}/data")
    assert any(name.endswith(".parquet") for name in inputs), inputs
    common = ["--input", f"{root}/data/train-*.parquet", "--epsilon", 1, "--delta", 1e-6,
              "--algorithm", "dpgd", "--steps", 4, "--steps-per-job", 2]
    _run(object_store, cwd, "train", *common, "--output", f"{root}/models/day1",
         "--checkpoint-dir", f"{root}/checkpoints/day1", "--seed", 3)
    first = publish.read(f"{root}/models/day1")
    assert {"model.json", "privacy_report.json", "report.html"} <= set(first)
    assert storage.list_files(f"{root}/checkpoints/day1"), "no checkpoint written to the store"

    # warm start from the store's model (on GCS: on S3 the model is read the same way by
    # predict below; Beam's S3 file system makes a client per call, ~0.25 s each, so each S3
    # run costs ~15 s and this test keeps to the runs that differ)
    model = f"{root}/models/day1"
    if object_store.scheme == "gs":
        _run(object_store, cwd, "train", *common, "--output", f"{root}/models/day2",
             "--warm-start", model, "--seed", 4)
        assert publish.read(f"{root}/models/day2", ["model.json"])
        model = f"{root}/models/day2"

    # predict: input and output on the store (on GCS; on S3 train's own reads and writes above
    # go the same way, at ~0.25 s a call)
    if object_store.scheme == "gs":
        _run(object_store, cwd, "predict", "--model", model, "--input",
             f"{root}/data/validation-*.parquet", "--output", f"{root}/predictions.csv")
        text = storage.read_text(f"{root}/predictions.csv")
        assert "prediction" in text.splitlines()[0] and len(text.splitlines()) > 10

    # --overwrite: refused without it, the model replaced with it
    refused = _run(object_store, cwd, "train", *common, "--output", f"{root}/models/day1",
                   "--seed", 5, check=False)
    assert refused.code == 2 and "already exists" in refused.err
    assert publish.read(f"{root}/models/day1") == first
    if object_store.scheme == "s3":
        assert list(cwd.iterdir()) == [], sorted(p.name for p in cwd.iterdir())
        return
    _run(object_store, cwd, "train", *common, "--output", f"{root}/models/day1", "--seed", 5,
         "--overwrite")
    assert publish.read(f"{root}/models/day1")["model.json"] != first["model.json"]

    assert list(cwd.iterdir()) == [], sorted(p.name for p in cwd.iterdir())


def test_a_publish_removes_what_an_earlier_beam_dp_killed_mid_replacement_left(tmp_path):
    """beam-dp before the manifest layout renamed a temporary directory over the output and left
    .OUT.tmp-* / .OUT.old-* beside it when killed there: the next publish of OUT removes those
    it can tell are beam-dp's, and keeps a look-alike that is not."""
    out = tmp_path / "model"
    old = tmp_path / ".model.old-abc123" / "previous"
    old.mkdir(parents=True)
    (old / publish.MANIFEST).write_text('{"written_by": "beam-dp", "files": {}}')
    (tmp_path / ".model.tmp-def456").mkdir()                       # killed before writing
    finished = tmp_path / ".model.tmp-ghi789"
    finished.mkdir()
    (finished / publish.MANIFEST).write_text('{"written_by": "beam-dp", "files": {}}')
    mine = tmp_path / ".model.tmp-notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's")
    publish.publish(str(out), _version_small(1))
    assert sorted(p.name for p in tmp_path.iterdir() if "model" in p.name) == [
        ".model.tmp-notes", "model"]


def test_overwrite_refuses_a_local_output_holding_an_empty_directory_of_a_user(tmp_path):
    """An entry that holds no file (an empty directory put into the output) is not beam-dp's:
    --overwrite refuses, and it is still there."""
    out = tmp_path / "model"
    publish.publish(str(out), _version_small(1))
    (out / "mine").mkdir()
    with pytest.raises(FileExistsError, match="did not write"):
        publish.publish(str(out), _version_small(2), overwrite=True)
    assert (out / "mine").is_dir() and publish.read(str(out)) == _version_small(1)


@pytest.mark.slow
def test_dpsgd_batch_files_on_the_store_merged_and_summed_by_the_workers(gcs_server, tmp_path,
                                                                       cli, monkeypatch):
    """DP-SGD's batch files under a gs:// temp location (issue 35): 16 shards, so the job
    merges the shards' files into a group's 8 (pyarrow reading Beam's GCS files by range) and
    deletes them; the steps summed by the driver and by the workers give the same model, and
    nothing is left under the temp location."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from beam_dp import batches, synthetic
    merged = []
    real_merge = batches.merge_pieces
    monkeypatch.setattr(batches, "merge_pieces",
                        lambda f, sources, codec=None: merged.append(codec) or
                        real_merge(f, sources, codec))
    x, y = synthetic.make_dataset("binary", 1600, 4, seed=2)
    table = {f"f{j}": x[:, j] for j in range(4)}
    table["label"] = y
    pq.write_table(pa.table(table), tmp_path / "train.parquet", row_group_size=100)
    temp = gcs_server.bucket() + "/tmp"
    models = {}
    for mode in ("driver", "workers"):
        r = cli("train", "--input", tmp_path / "train.parquet", "--output", tmp_path / mode,
                "--algorithm", "dpsgd", "--epsilon", 2, "--seed", 9, "--batch-size", 80,
                "--epochs", 2, "--batch-rows", 25, "--runner", "FnApiRunner",
                "--temp_location", temp, "--step_sums", mode)
        assert r.code == 0, r.err[-3000:]
        models[mode] = json.loads((tmp_path / mode / "model.json").read_text())
        assert storage.list_files(temp) == {}, storage.list_files(temp)
    assert merged and set(merged) == {"lz4"}   # (the in-process runner's workers: this process)
    np.testing.assert_allclose(models["workers"]["coefficients"],
                               models["driver"]["coefficients"], rtol=1e-9, atol=1e-12)
