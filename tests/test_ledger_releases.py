"""One ledger for everything that spends (issue 31, item 5): ``stats``, ``vocabulary`` and
``tune`` charged with --ledger as ``train`` is (refused before reading data, committed once, a
rerun writes the stored output and charges nothing), and a model trained on a released
vocabulary names it and states the composed epsilon.

Real components: the CLI in this process, a SQLite ledger file, the in-process (local) runner."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from dp_accounting import dp_event

from beam_dp import accounting
from beam_dp.cli.exit_codes import EXIT_REFUSED
from beam_dp.ledger import core, filter as rdp_filter


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
    """make-data's click log: string columns user, item, site, a number and a 0/1 label."""
    from beam_dp import cli
    out = tmp_path_factory.mktemp("clicks") / "data"
    assert cli.main(["make-data", "--task", "click-log", "--output", str(out), "--n", "3000",
                     "--validation-n", "0", "--values", "30", "--shards", "2"]) == 0
    return str(out / "train-*.parquet")


def _budget(cli, tmp_path, epsilon) -> str:
    ledger = str(tmp_path / "budget.db")
    assert cli("ledger", "budget", "--ledger", ledger, "--dataset-id", "ds", "--epsilon", epsilon,
               "--delta", 1e-4).code == 0
    return ledger


def _files(directory) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if not name.startswith(".")}


def _charges(ledger) -> list:
    with core.open_ledger(ledger) as opened:
        return opened.charges("ds")


COMMANDS = {
    "stats": ["--feature-columns", "position", "--label-column", "label", "--runner", "local",
              "--epsilon", 1],
    "vocabulary": ["--categorical-columns", "user,site", "--epsilon", 1, "--delta", 1e-6],
    "tune": ["--epsilon", 1, "--categorical-columns", "user,item,site",
             "--hash-buckets", 8, "--mean-candidates", 1, "--steps", 3, "--quality-check", "off"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_release_is_charged_once_and_refused_before_reading_data(command, clicks, tmp_path,
                                                                      cli):
    ledger = _budget(cli, tmp_path, 1.5)
    flags = [command, "--input", clicks, *COMMANDS[command], "--ledger", ledger, "--dataset-id",
             "ds", "--seed", 3]
    first = cli(*flags, "--output", tmp_path / "a")
    assert first.code == 0, first.err
    (charge,) = _charges(ledger)
    assert charge.status == "committed"
    # The ledger holds what the report says was released (stats, vocabulary), or for tune its
    # plan, admitted before any data was read, which bounds it at every Renyi order.
    report_name = "stats_report.json" if command == "stats" else "privacy_report.json"
    report = json.loads(_files(tmp_path / "a")[report_name])
    privacy = report.get("privacy", report)
    released = accounting.event_from_json(privacy["dp_event"])
    if command == "tune":
        curve = rdp_filter.rdp_curve(released, charge.neighbouring)
        assert np.all(curve <= charge.rdp_on(rdp_filter.ORDERS) * (1 + 1e-12))
    else:
        assert released == charge.event
    # A rerun writes the committed output again, byte for byte, and charges nothing.
    again = cli(*flags, "--output", tmp_path / "b")
    assert again.code == 0 and "already committed" in again.out
    assert [c.status for c in _charges(ledger)] == ["committed"]
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    # Another seed is another release: the 1.5 left cannot hold a second epsilon-1 release,
    # and it is refused before any data is read, nothing charged, nothing written.
    refused = cli(*flags[:-1], 4, "--output", tmp_path / "c")
    assert refused.code == EXIT_REFUSED and "refused before reading any data" in refused.err
    assert len(_charges(ledger)) == 1 and not (tmp_path / "c").exists()


def test_a_model_trained_on_a_released_vocabulary_reports_the_composed_epsilon(clicks, tmp_path,
                                                                              cli):
    ledger = _budget(cli, tmp_path, 4.0)
    common = ["--ledger", ledger, "--dataset-id", "ds", "--seed", 5]
    assert cli("vocabulary", "--input", clicks, "--output", tmp_path / "vocab",
               "--categorical-columns", "user,item,site", "--epsilon", 1, "--delta", 1e-6,
               *common).code == 0
    vocabulary = str(tmp_path / "vocab" / "vocabulary.json")
    run = cli("train", "--input", clicks, "--output", tmp_path / "model", "--runner", "local",
              "--epsilon", 1, "--categorical-columns", "user,item,site", "--vocabulary",
              vocabulary, "--steps", 5, *common)
    assert run.code == 0, run.err
    released = json.loads((tmp_path / "vocab" / "privacy_report.json").read_text())
    model = json.loads((tmp_path / "model" / "privacy_report.json").read_text())
    charges = {c.release_id: c for c in _charges(ledger)}
    assert set(charges) == {released["release_id"], model["release_id"]}
    (entry,) = model["inputs_released"]
    assert entry["release_id"] == released["release_id"] and entry["epsilon"] == released["epsilon"]
    composed = model["composed"]
    assert composed["delta"] == pytest.approx(model["delta"] + released["delta"])
    # dp_accounting's PLD of the two events together, at the summed delta: above each alone,
    # within basic composition (the sum of the epsilons).
    both = dp_event.ComposedDpEvent([accounting.event_from_json(model["dp_event"]),
                                     accounting.event_from_json(released["dp_event"])])
    assert composed["epsilon"] == pytest.approx(accounting.epsilon_of(
        both, composed["delta"], "pld", model["neighbouring"]), rel=1e-9)
    assert max(model["epsilon"], released["epsilon"]) < composed["epsilon"]
    assert composed["epsilon"] <= model["epsilon"] + released["epsilon"] + 1e-9
    # A vocabulary written by hand (no report beside it) is public input, and said so.
    hand = tmp_path / "hand" / "vocabulary.json"
    hand.parent.mkdir()
    hand.write_text((tmp_path / "vocab" / "vocabulary.json").read_text())
    run = cli("train", "--input", clicks, "--output", tmp_path / "model2", "--runner", "local",
              "--epsilon", 1, "--categorical-columns", "user,item,site", "--vocabulary", hand,
              "--steps", 5, "--seed", 5)
    assert run.code == 0, run.err
    model2 = json.loads((tmp_path / "model2" / "privacy_report.json").read_text())
    assert "public input" in model2["inputs_released"][0]["privacy"]
    assert "composed" not in model2
    # ... and so is one put beside another release's report (a model's): never composed with it
    beside_model = tmp_path / "model2" / "vocabulary.json"
    beside_model.write_text(hand.read_text())
    run = cli("train", "--input", clicks, "--output", tmp_path / "model3", "--runner", "local",
              "--epsilon", 1, "--categorical-columns", "user,item,site", "--vocabulary",
              beside_model, "--steps", 5, "--seed", 5)
    assert run.code == 0, run.err
    model3 = json.loads((tmp_path / "model3" / "privacy_report.json").read_text())
    assert "not a vocabulary release's" in model3["inputs_released"][0]["privacy"]
    assert "composed" not in model3


def test_an_epsilon_delta_release_is_a_pure_dp_one_with_its_delta_off_the_budget(tmp_path):
    """The filter's reading of an (epsilon, delta)-DP release (partition selection, objective
    perturbation): its epsilon in the RDP sum as a pure-DP mechanism's, its delta taken off the
    budget's delta before the conversion; a release whose delta is the whole budget's is
    refused."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    approx = dp_event.ComposedDpEvent([accounting.ApproxDpEvent(0.5, 2e-6),
                                       dp_event.GaussianDpEvent(3.0)])
    curve = rdp_filter.rdp_curve(approx, accounting.ADD_REMOVE)
    pure = rdp_filter.rdp_curve(dp_event.ComposedDpEvent([accounting.PureDpEvent(0.5),
                                                          dp_event.GaussianDpEvent(3.0)]),
                                accounting.ADD_REMOVE)
    assert len(curve) == rdp_filter.CURVE_LENGTH and curve[-1] == 2e-6 and pure[-1] == 0
    np.testing.assert_array_equal(curve[:-1], pure[:-1])
    expected = rdp_lib.compute_epsilon(list(rdp_filter.ORDERS), list(curve[:-1]),
                                       (1e-5 - 2e-6) / len(rdp_filter.ORDERS))[0]
    assert rdp_filter.epsilon(curve, 1e-5)[0] == pytest.approx(expected, rel=1e-12)
    assert rdp_filter.epsilon(curve, 1e-5)[0] > rdp_filter.epsilon(pure, 1e-5)[0]
    # Self-composed: k deltas.
    assert rdp_filter.rdp_curve(dp_event.SelfComposedDpEvent(
        accounting.ApproxDpEvent(0.5, 2e-6), 3), accounting.ADD_REMOVE)[-1] == pytest.approx(6e-6)
    with core.open_ledger(str(tmp_path / "l.db")) as ledger:
        ledger.set_budget("d", 10.0, 1e-5)
        with pytest.raises(core.BudgetExceeded):   # its delta alone is the whole budget's
            ledger.reserve("r1", "d", None, accounting.ApproxDpEvent(0.1, 1e-5))
        ledger.reserve("r2", "d", None, approx)
        view = ledger.explain("d")
        assert view.approx_delta == 2e-6
        assert view.spent_epsilon == pytest.approx(expected, rel=1e-12)
