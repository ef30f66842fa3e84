"""Batches fixed in advance (``beam_dp.batches``): batch plans, the order a step's batch is
assembled in, the Arrow batch files, and the Beam batch job that writes them, which must hand
every step exactly the arrays the local runner computes for it.

Every Beam job here runs on Beam's in-process runner (``FnApiRunner``).
"""
from __future__ import annotations

import io
import os
import random
import zlib

import numpy as np
import pytest

from beam_dp import batches, data, losses, synthetic
from beam_dp.algorithms.dp_ambssgd import Assignment
from beam_dp.block import Block
from beam_dp.sampling import PoissonSampler

LINEAR = losses.make_loss("linear")
SOFTMAX = losses.make_loss("softmax", num_classes=4)


def _block(rows: int, d: int, source: str, row_start: int, seed: int, tag: int = -1,
           loss=LINEAR) -> Block:
    g = np.random.default_rng(seed)
    features = g.standard_normal((rows, d))
    # Feature 0 names the row (file, position), so that where a row went is visible.
    features[:, 0] = row_start + np.arange(rows) + 1e6 * (zlib.crc32(source.encode()) % 97)
    raw = g.integers(0, 4, size=rows) if loss is SOFTMAX else g.standard_normal(rows)
    block = Block(features, loss.encode_labels(raw), source, row_start)
    block.tag = tag
    return block


def _same_blocks(got: list[Block], expected: list[Block]) -> None:
    assert len(got) == len(expected), (len(got), len(expected))
    for g, e in zip(got, expected):
        assert g.tag == e.tag
        assert g.features.dtype == e.features.dtype and g.labels.dtype == e.labels.dtype
        np.testing.assert_array_equal(g.features, e.features)
        np.testing.assert_array_equal(g.labels, e.labels)
        np.testing.assert_array_equal(g.sq_norms, e.sq_norms)


# --------------------------------------------------------------------------- batch files


@pytest.mark.parametrize("codec", [None, "lz4"])
@pytest.mark.parametrize("loss", [LINEAR, SOFTMAX], ids=["linear", "softmax"])
def test_pieces_file_round_trip_keeps_features_labels_steps_and_tags(loss, codec):
    d = 3
    blocks = [(7, _block(4, d, "b.parquet", 0, 1, 2, loss)),
              (5, _block(3, d, "b.parquet", 10, 2, 1, loss)),
              (5, _block(2, d, "a.parquet", 20, 3, 1, loss)),
              (5, _block(5, d, "a.parquet", 0, 4, 0, loss)),
              (7, _block(1, d, "a.parquet", 3, 5, -1, loss))]
    f = io.BytesIO()
    batches.write_pieces(f, [[batches.as_piece(step, b) for step, b in blocks]], d, codec)
    read = list(batches.read_pieces(f.getvalue()))

    assert len(read) == len(blocks)
    for (step, tag, features, labels), (want_step, block) in zip(read, blocks):   # in order
        assert (step, tag) == (want_step, block.tag)
        assert features.dtype == np.float64 and features.shape == block.features.shape
        np.testing.assert_array_equal(features, block.features)
        assert labels.dtype == block.labels.dtype   # class ids stay integers (they index)
        np.testing.assert_array_equal(labels, block.labels)
    if loss is SOFTMAX:
        assert read[0][3].dtype.kind == "i"
    assert batches.compression("gs://bucket/tmp") == "lz4"
    assert batches.compression("/tmp/x") is None


def _write_job_files(location, pieces, shards, per_file, d, parts, arrival_order):
    """What the batch job writes, made here without Beam: per shard one file of its pieces
    in block order, a record batch per group, the (group, part) of each batch; per (group, part)
    one file written by the job's own ``_write_group_file`` from those batches' names in the
    order ``arrival_order`` gives them (the shuffle's order is arbitrary)."""
    from beam_dp.beam.batches import _write_group_file

    keyed = {}
    for index, shard in enumerate(shards):
        ordered = sorted(((step, b) for step, b in pieces if b.source == shard),
                         key=lambda p: (p[1].row_start, p[0], p[1].tag))
        by_group = {}
        for step, block in ordered:
            by_group.setdefault(step // per_file, []).append(batches.as_piece(step, block))
        name = batches.shard_file_name(index, "attempt")
        with open(os.path.join(location, name), "wb") as f:
            batches.write_pieces(f, [by_group[g] for g in sorted(by_group)], d)
        for number, group in enumerate(sorted(by_group)):
            part = batches.part_of_shard(index, len(shards), parts)
            keyed.setdefault((group, part), []).append((index, name, number))
    written = []
    for key, sources in keyed.items():
        written += list(_write_group_file((key, arrival_order(sources)), location))
    return sorted(written)


def test_assemble_order_is_what_file_batches_return_for_shuffled_pieces(tmp_path):
    d = 4
    shards = ["/data/a.parquet", "/data/b.parquet", "/data/c.csv"]   # in the job's shard order
    pieces = []
    for step in range(6):
        for source in shards:
            for row_start in (0, 50, 100):
                for tag in ((2 * step, 2 * step + 1) if step % 2 else (-1,)):
                    seed = len(pieces)
                    pieces.append((step, _block(1 + seed % 3, d, source, row_start, seed, tag)))
    shuffled = pieces[:]
    random.Random(5).shuffle(shuffled)
    assert shuffled != pieces

    # Steps 0-1 in group 0, 2-3 in group 1 (left with no rows: no files), 4-5 in group 2.
    per_file = 2
    kept = [(s, b) for s, b in shuffled if s // per_file != 1]
    rng = random.Random(6)
    files = _write_job_files(str(tmp_path), kept, shards, per_file, d, 2,
                             lambda items: rng.sample(items, len(items)))
    # Two parts per group (shards a | b, c), only groups 0 and 2 have rows.
    assert sorted(batches.group_of_file(f) for f in files) == [0, 0, 2, 2]
    manifest = batches.Manifest("x", 6, per_file, files)
    reader = batches.FileBatches(manifest, lambda name: (tmp_path / name).read_bytes())
    for step in range(6):
        got = reader.get(step)
        if step // per_file == 1:
            assert got == []
            continue
        _same_blocks(got, batches.assemble(b for s, b in shuffled if s == step))
        # Within a tag: by (file, first row), whatever order the pieces came in.
        ordered = sorted((b for s, b in pieces if s == step),
                         key=lambda b: (b.tag, b.source, b.row_start))
        np.testing.assert_array_equal(np.concatenate([b.features for b in got]),
                                      np.concatenate([b.features for b in ordered]))


# --------------------------------------------------------------------------- batch plans


def _blocks_of(n: int, d: int, batch_rows: int, source: str = "/data/x.parquet"):
    x, y = synthetic.make_dataset("regression", n, d, seed=3)
    x[:, 0] = np.arange(n)   # the row's id
    return [data.validated_block(x[i:i + batch_rows], y[i:i + batch_rows], LINEAR, source, i)
            for i in range(0, n, batch_rows)]


@pytest.mark.parametrize("rate", [0.05, 0.3, 1.0])
def test_poisson_plan_pieces_are_the_samplers_rows(rate):
    sampler = PoissonSampler(rate, seed=17)
    plan = batches.PoissonPlan(sampler, rate * 500)
    blocks = _blocks_of(500, 3, 64)
    steps = range(9)
    seen = 0
    for block in blocks:
        got = list(plan.pieces(block, steps))
        expected = []
        for step in steps:
            rows = sampler.rows(block, step)
            if rows is None:
                expected.append((step, block))
            elif len(rows):
                expected.append((step, block.take(rows)))
        assert [s for s, _ in got] == [s for s, _ in expected]
        for (_, piece), (_, want) in zip(got, expected):
            assert (piece.source, piece.row_start) == (block.source, block.row_start)
            _same_blocks([piece], [want])
        seen += sum(len(p) for _, p in got)
        # A subset of the steps gives those steps' pieces only.
        assert [s for s, _ in plan.pieces(block, [2, 5])] == [s for s, _ in expected if s in (2, 5)]
    if rate == 1.0:
        assert seen == 500 * len(steps)
    else:
        assert 0 < seen < 500 * len(steps)


def test_ambssgd_assignment_gives_each_row_to_exactly_one_step():
    T = 7
    plan = Assignment(seed=23, blocks=T, stat_fraction=0.2, expected_rows=600 / T)
    blocks = _blocks_of(600, 3, 128)
    owner = {}
    for block in blocks:
        for step, part in plan.pieces(block, range(T)):
            assert 0 <= step < T
            assert part.tag in (2 * step, 2 * step + 1)
            for row in part.features[:, 0].astype(int):
                assert row not in owner, row
                owner[row] = (step, part.tag)
        # Asked for some steps only: exactly those parts.
        some = list(plan.pieces(block, [1, 4]))
        every = [(s, p) for s, p in plan.pieces(block, range(T)) if s in (1, 4)]
        assert [(s, p.tag) for s, p in some] == [(s, p.tag) for s, p in every]
    assert sorted(owner) == list(range(600))
    steps = [s for s, _ in owner.values()]
    assert set(steps) == set(range(T))
    stat_share = np.mean([tag % 2 == 0 for _, tag in owner.values()])
    assert 0.1 < stat_share < 0.3


# --------------------------------------------------------- the Beam batch job vs the local runner


def _parquet_input(tmp_path, task, n, d, shards):
    x, y = synthetic.make_dataset(task, n, d, seed=9, num_classes=4)
    files = synthetic.write_shards(str(tmp_path / "data"), "train", x, y, shards)
    return files, [f"f{j}" for j in range(d)]


@pytest.mark.parametrize("kind", ["poisson-linear", "poisson-softmax", "ambssgd"])
def test_local_batches_equal_the_batches_the_beam_job_writes(tmp_path, monkeypatch, kind):
    from beam_dp.beam.aggregator import BeamAggregator

    task, loss = ("multiclass", SOFTMAX) if kind == "poisson-softmax" else ("regression", LINEAR)
    n, d, steps, batch_rows = 900, 3, 12, 100
    files, columns = _parquet_input(tmp_path, task, n, d, 3)
    if kind == "ambssgd":
        plan = Assignment(seed=5, blocks=steps, stat_fraction=0.25, expected_rows=n / steps)
    else:   # q n = 0.9 rows a step: some steps empty
        plan = batches.PoissonPlan(PoissonSampler(0.001, seed=5), 0.001 * n)
    # Files of 3 steps each, so that several files are written and read (some possibly missing).
    monkeypatch.setattr(batches, "FILE_BYTES", int(3 * plan.expected_rows * 8 * (d + 2)))
    assert batches.steps_per_file(plan.expected_rows, d) == 3

    temp = tmp_path / "beam-temp"
    aggregator = BeamAggregator(files, "label", columns, loss, batch_rows,
                                ["--runner", "FnApiRunner", "--temp_location", str(temp)])
    local = batches.LocalBatches(data.load_blocks(files, "label", columns, loss, batch_rows), plan)
    total_rows = 0
    empty_steps = 0
    with aggregator.step_batches(plan, steps) as written:
        assert [j["kind"] for j in aggregator.jobs] == ["batches"]
        assert written.location.startswith(str(temp))
        group_files = sorted(n for n in os.listdir(written.location) if n.endswith(".arrow"))
        assert group_files == written.manifest.files and len(group_files) >= 2
        for step in range(steps):
            got, expected = written.get(step), local.get(step)
            _same_blocks(got, expected)
            total_rows += sum(len(b) for b in got)
            empty_steps += not got
            if kind == "poisson-softmax" and got:
                assert got[0].labels.dtype.kind == "i"
    aggregator.close()
    if kind == "ambssgd":
        assert total_rows == n   # one pass: every row in exactly one step
        assert all(len(local.get(t)) == 2 for t in range(steps))   # statistics and gradient parts
    else:
        assert 0 < total_rows and empty_steps > 0, (total_rows, empty_steps)
    assert not os.path.exists(written.location)   # deleted on exit


def test_pieces_round_trip_in_one_record_batch_keeping_each_piece():
    """One record batch per file (FILE_FORMAT 2): adjacent pieces of the same step and tag
    stay separate pieces (a step sums block by block, as the local runner does), an empty
    piece is dropped (it adds nothing), labels keep their type."""
    g = np.random.default_rng(0)
    pieces = [(0, 0, g.standard_normal((2, 3)), np.array([1, 0])),
              (0, 0, g.standard_normal((3, 3)), np.array([2, 2, 1])),
              (1, 0, np.zeros((0, 3)), np.zeros(0, dtype=np.int64)),
              (1, 1, g.standard_normal((1, 3)), np.array([0]))]
    f = io.BytesIO()
    batches.write_pieces(f, [pieces], 3)
    back = list(batches.read_pieces(f.getvalue()))
    kept = [p for p in pieces if len(p[3])]
    assert [(s, t) for s, t, _, _ in back] == [(s, t) for s, t, _, _ in kept]
    for (_, _, x, y), (_, _, x0, y0) in zip(back, kept):
        np.testing.assert_array_equal(x, x0)
        np.testing.assert_array_equal(y, y0)
        assert y.dtype == y0.dtype
