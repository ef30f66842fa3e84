"""``beam-dp stats --categorical-columns``: categorical frequencies by the projection mechanism
(paper 001, Algorithm 1) as stages through the Aggregator seam (``beam_dp.stats``,
"categorical frequencies"): the CLI end to end on CSV files with string columns, the local and
Beam runners agreeing for a seed, the released frequencies within the bound derived from the
noise scale and the projection (Lemma 3.1), the noise's scale as calibrated, the Laplace
variant's enforced l1 clip, no densified rows at 2^20 buckets, refusals, and no data value in
any output."""
import json
import math
import os

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp
from dp_accounting.pld import privacy_loss_distribution as pld

from beam_dp import categorical, cli, data, geometry, stats
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

COLUMNS = ("color", "city")
VALUES = {"color": [f"colour-secret-{i:03d}" for i in range(12)],
          "city": [f"town-secret-{i:03d}" for i in range(40)]}


def _table(n: int, seed: int) -> dict:
    """String columns with Zipf-like popularity (a few values common, most rare), a numeric
    column and a label; every value's text is distinctive, to look for it in the outputs."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in COLUMNS:
        values = VALUES[name]
        p = np.arange(1, len(values) + 1, dtype=float) ** -1.2
        out[name] = np.array(values)[rng.choice(len(values), n, p=p / p.sum())]
    out["x"] = rng.normal(size=n)
    out["label"] = rng.integers(0, 2, n)
    return out


def _write_csv(directory, table: dict, shards: int = 2) -> str:
    import pyarrow.csv as pacsv

    os.makedirs(directory, exist_ok=True)
    n = len(table["x"])
    for k, part in enumerate(np.array_split(np.arange(n), shards)):
        pacsv.write_csv(pa.table({c: v[part] for c, v in table.items()}),
                        os.path.join(directory, f"train-{k}.csv"))
    return os.path.join(directory, "train-*.csv")


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sparse-stats")
    table = _table(4000, 5)
    pattern = _write_csv(str(directory / "csv"), table)
    vocabulary = directory / "vocabulary.json"
    # a public vocabulary that leaves some values out (they go to "other")
    vocabulary.write_text(json.dumps({"color": VALUES["color"][:8], "city": VALUES["city"][:10]}))
    return {"pattern": pattern, "table": table, "vocabulary": str(vocabulary),
            "directory": directory}


def _run(args, capsys=None):
    code = cli.main(["stats", *[str(a) for a in args]])
    captured = capsys.readouterr() if capsys is not None else None
    return code, captured


def _report(output) -> dict:
    with open(os.path.join(output, "stats_report.json")) as f:
        return json.load(f)


def _exact_vocabulary_frequencies(table: dict, vocabulary: dict) -> dict:
    n = len(table["x"])
    out = {}
    for name in COLUMNS:
        values, counts = np.unique(table[name], return_counts=True)
        by_value = dict(zip(values.tolist(), (counts / n).tolist()))
        listed = {v: by_value.get(v, 0.0) for v in vocabulary[name]}
        out[name] = (listed, 1.0 - sum(listed.values()))
    return out


def _vector(report: dict, encoding) -> np.ndarray:
    """The released frequencies as the d-vector of the encoding's ids."""
    out = np.zeros(encoding.dim)
    for name, start, width, values in stats.frequency_layout(encoding):
        entry = report["categorical_frequencies"][name]
        if values is None:
            for b, f in entry["buckets"].items():
                out[start + int(b)] = f
        else:
            out[start:start + width - 1] = [entry["values"][v] for v in values]
            out[start + width - 1] = entry["other"]
    return out


# ------------------------------------------------------------------------------ end to end

def test_cli_vocabulary_frequencies_within_the_mechanism_bound(clicks, tmp_path, capsys):
    """Public n (--num-examples): every frequency by value name and "other", each with the
    mechanism and its noise scale; the l2 distance to the exact frequencies within the report's
    95% bound (Lemma 3.1 with the Gaussian's tail on ||noise||_inf)."""
    n = len(clicks["table"]["x"])
    out = tmp_path / "out"
    code, captured = _run(["--input", clicks["pattern"], "--categorical-columns", "color,city",
                           "--vocabulary", clicks["vocabulary"], "--epsilon", 1, "--delta", 1e-6,
                           "--num-examples", n, "--runner", "local", "--seed", 1,
                           "--output", out], capsys)
    assert code == 0, captured.err
    report = _report(out)
    assert report["count"] == n and report["count_source"] == "public (--num-examples)"
    vocabulary = json.load(open(clicks["vocabulary"]))
    exact = _exact_vocabulary_frequencies(clicks["table"], vocabulary)
    mechanism = report["sparse_mechanism"]
    assert mechanism["sparsity"] == 2 and mechanism["lipschitz"] == pytest.approx(math.sqrt(2))
    assert mechanism["columns"] == 8 + 1 + 10 + 1
    released, truth = [], []
    for name in COLUMNS:
        entry = report["categorical_frequencies"][name]
        assert "projection mechanism" in entry["mechanism"]
        assert entry["noise_scale"] == mechanism["noise_scale"] > 0
        assert list(entry["values"]) == vocabulary[name]
        released += list(entry["values"].values()) + [entry["other"]]
        truth += list(exact[name][0].values()) + [exact[name][1]]
    error = float(np.linalg.norm(np.array(released) - np.array(truth)))
    assert error <= mechanism["l2_error_bound_95"]
    privacy = report["privacy"]
    assert privacy["neighbouring"] == "replace-one"
    assert privacy["epsilon"] <= 1.0 * (1 + 1e-9)
    assert "does not depend on s" in privacy["privacy_and_sparsity"]
    assert [m["name"] for m in privacy["mechanisms"]] == ["projection_mechanism_gaussian_mean"]
    assert [e["class_name"] for e in privacy["dp_event"]["events"]] == ["GaussianDpEvent"]
    assert "categorical columns" in captured.out


@pytest.mark.parametrize("variant", stats.SPARSE_MEAN_VARIANTS)
def test_released_frequencies_within_the_bound_on_every_seed(clicks, variant):
    """Seeded statistical check on the stages (the CLI's): 30 draws at a budget where the noise
    matters (n = 4000, epsilon 0.3), each within the bound at beta = 0.001 (Lemma 3.1: the
    exact mean lies in the ball; ||noise||_inf below its 1 - beta quantile; or the dense
    error, the smaller), and the bound is not vacuous (well below the diameter of the ball)."""
    table = clicks["table"]
    vocabulary = json.load(open(clicks["vocabulary"]))
    encoding = stats.frequency_encoding(list(COLUMNS), vocabulary=clicks["vocabulary"])
    blocks = data.load_blocks(sorted(_glob(clicks["pattern"])), None, encoding.columns,
                              _loss(), 700, encoding)
    exact = _exact_vocabulary_frequencies(table, vocabulary)
    truth = np.concatenate([list(exact[c][0].values()) + [exact[c][1]] for c in COLUMNS])
    n = len(table["x"])
    for seed in range(30):
        stages = stats.categorical_frequency_stages(encoding, variant, 0.3, 1e-6,
                                                    stats.stages_seed(seed), count=False)
        state = LocalAggregator(blocks).run_stages(stages, {"n": n})
        stage = stages[0]
        scale = state["categorical_frequencies_noise_scale"]
        error = float(np.linalg.norm(state["categorical_frequencies"] - truth))
        assert error <= stage.error_bound(scale, failure_probability=1e-3), (seed, error)
        assert np.abs(state["categorical_frequencies"]).sum() <= stage.radius * (1 + 1e-9)
    # not vacuous: well inside the ball's diameter (2 k in l1, so at most 2 k in l2)
    assert stage.error_bound(scale) < 0.5


@pytest.mark.parametrize("variant", stats.SPARSE_MEAN_VARIANTS)
def test_the_noise_is_at_the_calibrated_scale(clicks, variant, monkeypatch):
    """With the projection taken out (identity), release - exact mean is the noise alone: its
    empirical standard deviation over 5 draws x d coordinates is the calibrated one (sigma, or
    b sqrt(2) for Laplace) within 5 standard errors; and the Gaussian's multiplier meets the
    target by dp_accounting directly (replace-one: sensitivity 2 units of L)."""
    monkeypatch.setattr(geometry, "project_l1_ball", lambda v, r: v)
    encoding = stats.frequency_encoding(list(COLUMNS), hash_buckets=2000)
    blocks = data.load_blocks(sorted(_glob(clicks["pattern"])), None, encoding.columns, _loss(),
                              1000, encoding)
    n = sum(len(b) for b in blocks)
    exact = sum(np.asarray(b.features.sum(axis=0)).ravel() for b in blocks) / n
    epsilon, delta = 2.0, 1e-6
    noise = []
    for seed in range(5):
        stages = stats.categorical_frequency_stages(encoding, variant, epsilon, delta,
                                                    stats.stages_seed(seed), count=False)
        state = LocalAggregator(blocks).run_stages(stages, {"n": n})
        noise.append(state["categorical_frequencies"] - exact)
    noise = np.concatenate(noise)
    stage = stages[0]
    if variant == "gaussian":
        found = pld.from_gaussian_mechanism(stage.noise_parameter, sensitivity=2.0,
                                            value_discretization_interval=1e-4)
        assert found.get_epsilon_for_delta(delta) == pytest.approx(epsilon, rel=3e-3)
        expected = stage.noise_parameter * math.sqrt(2) / n
    else:
        # epsilon, lowered only as far as the accountant's pessimistic discretization needs
        assert epsilon * (1 - 2e-3) <= stage.noise_parameter <= epsilon
        # b = 2 L sqrt(s) / (n eps), s = 2
        expected = 2.0 * 2.0 / (n * stage.noise_parameter) * math.sqrt(2)
    assert state["categorical_frequencies_noise_scale"] * (1 if variant == "gaussian" else math.sqrt(2)) \
        == pytest.approx(expected, rel=1e-9)
    # std of the sample std: sigma sqrt((kurtosis - 1) / (4 N)); kurtosis 3 (Gaussian), 6 (Laplace)
    kurtosis = 3.0 if variant == "gaussian" else 6.0
    se = expected * math.sqrt((kurtosis - 1) / (4 * noise.size))
    assert abs(float(np.sqrt(np.mean(noise ** 2))) - expected) <= 5 * se


def test_the_laplace_variant_clips_rows_to_l1_inside_the_mechanism():
    """A row the encoder would never make (l1 norm 40, e.g. a bug or a tampered block) moves the
    Laplace variant's sum by at most L sqrt(s) = s in l1: the clip the privacy needs is
    enforced in the stage, not assumed; the Gaussian variant's clip is l2 <= L."""
    s, d = 2, 50
    rows = sp.csr_matrix(np.vstack([np.full((1, d), 0.8), np.eye(1, d)]))
    block = Block(features=rows, labels=np.zeros(2))
    stage = stats.SparseMeanStage("f", 0, d, "laplace", math.sqrt(s), s, 1.0, 0)
    total = stage.partial_sum(block, {})
    assert np.abs(total).sum() <= s + 1.0 + 1e-9          # the big row clipped to l1 = s, plus 1
    assert np.abs(total).sum() == pytest.approx(s + 1.0, rel=1e-9)
    gaussian = stats.SparseMeanStage("f", 0, d, "gaussian", math.sqrt(s), s, 1.0, 0)
    g = gaussian.partial_sum(block, {})
    assert np.linalg.norm(g - np.eye(1, d)[0]) == pytest.approx(math.sqrt(s), rel=1e-9)


def test_local_and_beam_agree_for_a_seed(clicks, tmp_path, capsys):
    """Hashing, a private count, the default (Beam in-process) runner against --runner local:
    the same frequencies for the same seed (sums added in another order: float tolerance)."""
    common = ["--input", clicks["pattern"], "--categorical-columns", "color,city",
              "--hash-buckets", 256, "--epsilon", 1, "--seed", 7, "--batch-rows", 500]
    code, captured = _run([*common, "--runner", "local", "--output", tmp_path / "local"], capsys)
    assert code == 0, captured.err
    code, captured = _run([*common, "--output", tmp_path / "beam"], capsys)
    assert code == 0, captured.err
    local, beam = _report(tmp_path / "local"), _report(tmp_path / "beam")
    assert local["count"] == beam["count"]
    assert local["count_source"] == "private estimate: Laplace count"
    encoding = stats.frequency_encoding(list(COLUMNS), hash_buckets=256)
    np.testing.assert_allclose(_vector(local, encoding), _vector(beam, encoding), atol=1e-12)
    names = [m["name"] for m in local["privacy"]["mechanisms"]]
    assert names == ["laplace_count", "projection_mechanism_gaussian_mean"]
    assert local["privacy"]["epsilon"] <= 1.0 * (1 + 1e-9)


def test_laplace_cli_is_pure_and_says_the_clip_is_enforced(clicks, tmp_path, capsys):
    code, captured = _run(["--input", clicks["pattern"], "--categorical-columns", "color,city",
                           "--hash-buckets", 64, "--sparse-mechanism", "laplace",
                           "--epsilon", 1, "--runner", "local", "--seed", 2,
                           "--output", tmp_path / "out"], capsys)
    assert code == 0, captured.err
    report = _report(tmp_path / "out")
    privacy = report["privacy"]
    assert privacy["neighbouring"] == "replace-one"
    assert "enforced" in privacy["privacy_and_sparsity"] and "l1" in privacy["privacy_and_sparsity"]
    assert "enforced" in report["notes"]
    laplace = privacy["mechanisms"][1]
    assert laplace["name"] == "projection_mechanism_laplace_mean"
    assert laplace["l1_clip"] == pytest.approx(2.0)   # L sqrt(s) = sqrt(2) sqrt(2)
    # two pure releases: pure epsilon-DP at their sum, the requested one (to the accountant's
    # discretization)
    spent = laplace["epsilon"] + privacy["mechanisms"][0]["epsilon"]
    assert 1.0 * (1 - 2e-3) <= spent <= 1.0
    assert privacy["epsilon"] <= 1.0 * (1 + 1e-9)
    assert "(pure)" in captured.out


def test_hashing_never_prints_a_value(clicks, tmp_path, capsys):
    """Hashed columns are reported by bucket id only: no categorical value's text in stdout,
    stderr or the JSON, on success and on a refusal."""
    code, captured = _run(["--input", clicks["pattern"], "--categorical-columns", "color,city",
                           "--hash-buckets", 32, "--epsilon", 0.05, "--runner", "local",
                           "--output", tmp_path / "out"], capsys)
    assert code == 0, captured.err
    text = captured.out + captured.err + (tmp_path / "out" / "stats_report.json").read_text()
    code, refused = _run(["--input", clicks["pattern"], "--categorical-columns", "color,x,nope",
                          "--hash-buckets", 32, "--epsilon", 1, "--runner", "local",
                          "--output", tmp_path / "refused"], capsys)
    assert code == 2
    text += refused.out + refused.err
    for values in VALUES.values():
        for value in values:
            assert value not in text
    assert "secret" not in text


def test_2_to_the_20_buckets_never_densify_a_row(clicks, tmp_path, capsys, monkeypatch):
    """d = 3 x 2^20 ids: the kernel keeps the rows sparse (no toarray / todense of a block) and
    the report lists only the nonzero buckets the projection leaves."""
    def refuse(self, *a, **k):
        raise AssertionError("a sparse block was densified")
    for cls in (sp.csr_matrix, sp.csr_array):
        monkeypatch.setattr(cls, "toarray", refuse)
        monkeypatch.setattr(cls, "todense", refuse)
    code, captured = _run(["--input", clicks["pattern"], "--categorical-columns", "color,city,label",
                           "--hash-buckets", 2 ** 20, "--epsilon", 1, "--runner", "local",
                           "--seed", 3, "--output", tmp_path / "out"], capsys)
    assert code == 0, captured.err
    report = _report(tmp_path / "out")
    assert report["sparse_mechanism"]["columns"] == 3 * 2 ** 20
    for entry in report["categorical_frequencies"].values():
        assert entry["buckets_total"] == 2 ** 20
        assert 0 < entry["buckets_listed"] < 1000


@pytest.mark.parametrize("extra, message", [
    (["--sparse-mechanism", "laplace"], "--sparse-mechanism is the noise of the categorical"),
    (["--hash-buckets", "8"], "--hash-buckets and --vocabulary need --categorical-columns"),
    (["--categorical-columns", "color", "--hash-buckets", "8", "--noise", "secure"],
     "--noise secure"),
    (["--categorical-columns", "color", "--hash-buckets", "8", "--sparse-mechanism", "laplace",
      "--noise", "secure"], "float noise only"),
    (["--categorical-columns", "color", "--hash-buckets", "8", "--feature-columns", "x"],
     "run it once for each"),
    (["--categorical-columns", "color"], "exactly one of --hash-buckets or --vocabulary"),
    (["--categorical-columns", "color,nope", "--hash-buckets", "8"],
     "categorical column(s) not found: nope"),
])
def test_refusals(clicks, tmp_path, capsys, extra, message):
    code, captured = _run(["--input", clicks["pattern"], "--epsilon", 1, "--runner", "local",
                           "--output", tmp_path / "out", *extra], capsys)
    assert code == 2
    assert message in captured.err
    assert not (tmp_path / "out" / "stats_report.json").exists()


def test_an_unknown_sparse_mechanism_is_a_usage_error(clicks, tmp_path, capsys):
    code, captured = _run(["--input", clicks["pattern"], "--epsilon", 1, "--categorical-columns",
                           "color", "--hash-buckets", 8, "--sparse-mechanism", "uniform",
                           "--output", tmp_path / "out"], capsys)
    assert code == 2 and "invalid choice" in captured.err


def test_column_block_hashing_keeps_train_buckets_apart():
    """Column j's bucket is train's bucket for the value, offset by j B: every row exactly one 1
    per column even where two columns' values share train's bucket."""
    values = pa.array(["a", "b", "a"])
    train = categorical.Encoding((), ("p", "q"), hash_buckets=1)   # every value in bucket 0
    blocks = stats.frequency_encoding(["p", "q"], hash_buckets=1)
    assert blocks.dim == 2
    np.testing.assert_array_equal(blocks.column_ids("q", values), train.column_ids("q", values) + 1)
    rows = blocks.encode(np.zeros((3, 0)), {"p": values, "q": values})
    np.testing.assert_array_equal(rows.toarray(), np.ones((3, 2)))
    assert train.encode(np.zeros((3, 0)), {"p": values, "q": values}).toarray().tolist() == [[2.0]] * 3


def _glob(pattern):
    import glob
    return glob.glob(pattern)


def _loss():
    from beam_dp import losses
    return losses.SquaredLoss()


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("variant", stats.SPARSE_MEAN_VARIANTS)
@pytest.mark.parametrize("count", [True, False])
def test_the_accountants_epsilon_meets_the_request(accountant, variant, count):
    """The ledger's epsilon (replace-one, each accountant) is at most the requested one and close
    to it; the Laplace variant is also pure epsilon-DP by basic composition (RDP's conversion of
    pure events is looser than their sum, so there the mean's share is lowered)."""
    from beam_dp import accounting

    encoding = stats.frequency_encoding(list(COLUMNS), hash_buckets=16)
    epsilon, delta = 0.5, 1e-5
    stages = stats.categorical_frequency_stages(encoding, variant, epsilon, delta, 0, count=count,
                                                accountant=accountant)
    ledger = accounting.Ledger(accountant, accounting.REPLACE_ONE)
    stats.record_releases(stages, ledger)
    spent = ledger.epsilon(delta)
    assert 0.97 * epsilon <= spent <= epsilon * (1 + 1e-9)
    if variant == "laplace":
        assert sum(m["epsilon"] for m in ledger.mechanisms()) <= epsilon * (1 + 1e-12)
