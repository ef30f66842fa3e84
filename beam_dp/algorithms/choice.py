"""``--algorithm auto``: the algorithm the measurements favour for the model, the options given
and the dataset's public size (issue 15 item 3).

The rule is a function of public inputs only: the model, the names of the algorithm options the
user gave, the request's shape (categorical columns, user-level privacy, a checkpoint directory,
a warm start, no intercept, secure noise asked for) and, if the user declared one, the number of
rows (``--num-examples``, which is then public for the accounting too, or ``--rows-hint``, which
is read by this rule only). It never reads the data, and it reads no private release either: a
rule that waited for the private count would have to run inside the algorithm, after the count
is in the ledger; with the figures of docs/benchmarks/real-tables.md it would rarely change the answer (below).

What it chooses and why (docs/guide/algorithms.md "Which algorithm for which data"; docs/benchmarks/real-tables.md, Table C and the raw tables):

* dpgd: the best or within 0.02 of the best on every real table measured, classification and
  regression, with nothing to tune but the clip norm; it reads all the data at every step (100
  steps by default), which is affordable up to a few million rows.
* dpsgd: only where a full pass per step is too slow (``FULL_PASS_ROWS`` declared rows or more),
  and only for classification: with its defaults it matched dpgd on the classification tables
  but was behind on regression (R^2 0.912 and 0.775 against dpgd's 0.952 and 0.777 with its
  step 1/2; -0.09 and 0.30 with the earlier step 2), so a regression stays with dpgd at any
  size.
* With ``--privacy-unit-column`` dpgd at any size: dpsgd's user-level steps read and group the
  whole input once per job (their batch is drawn from the grouped users), so they do not save
  dpgd's passes as row-level dpsgd does.
* Options only one of them takes (dpsgd's ``--batch-size``, dpgd's ``--rank``) choose that one;
  a request neither serves is an error naming why.

So without a declared size, and for every table the docs' benchmarks measure, ``auto`` resolves to dpgd
(the default of ``--algorithm``), and says so in the report (``algorithm_choice``).
"""
from __future__ import annotations

import dataclasses

from beam_dp.algorithms import registry, spec

AUTO = "auto"
# In the order the measurements prefer them (below FULL_PASS_ROWS).
CANDIDATES = ("dpgd", "dpsgd")
# Declared rows from which dpgd's full pass per step is "too slow": 100 steps read the data 100
# times (at n = 10^6 and d = 50 a local step took 46 ms, docs/benchmarks/speed.md: 10^7 rows is 100
# passes over ~4 GB, where dpsgd's 5 epochs read it about 5 times).
FULL_PASS_ROWS = 10_000_000
# dpsgd with its defaults lost on these (docs/guide/algorithms.md).
REGRESSION_MODELS = ("linear", "huber")
WHY_DPGD = ("the best or within 0.02 of the best on every real table measured (docs: 'Which "
            "algorithm for which data')")


@dataclasses.dataclass(frozen=True)
class Choice:
    algorithm: str
    reason: str
    rows: int | None = None         # the public size the rule read (None: none declared)
    rows_source: str | None = None  # "--num-examples" or "--rows-hint"

    def report(self) -> dict:
        """The report's ``algorithm_choice``: public inputs and the rule's answer only."""
        return {"requested": AUTO, "chosen": self.algorithm, "reason": self.reason,
                "rows": self.rows, "rows_source": self.rows_source,
                "rule": f"dpgd, or dpsgd for classification from {FULL_PASS_ROWS:,} declared rows; "
                        "options only one of them takes choose it"}


def option_names() -> list[str]:
    """The option names ``auto`` accepts: those of any candidate, in order, each once."""
    names: list[str] = []
    for name in CANDIDATES:
        for f, _ in spec.fields(registry.get(name).options):
            if f.name not in names:
                names.append(f.name)
    return names


def relation() -> str:
    """The neighbouring relation of whatever ``auto`` chooses (the candidates share it)."""
    relations = {registry.get(name).relation for name in CANDIDATES}
    assert len(relations) == 1, relations
    return relations.pop()


def _refusals(algorithm: spec.Algorithm, model: str, given, *, sparse: bool,
              user_level: bool, checkpoint: bool, warm_start: bool, fit_intercept: bool,
              noise: str | None) -> list[str]:
    """Why ``algorithm`` cannot serve the request (empty: it can), in words for an error."""
    own = {f.name for f, _ in spec.fields(algorithm.options)}
    why = []
    if model not in algorithm.models:
        why.append(f"it does not fit --model {model}")
    foreign = [spec.flag(name) for name in given if name not in own]
    if foreign:
        why.append(f"it has no {', '.join(foreign)}")
    for asked, able, what in ((sparse, algorithm.sparse_input, "categorical columns"),
                              (user_level, algorithm.user_level, "--privacy-unit-column"),
                              (checkpoint, algorithm.checkpoints, "--checkpoint-dir"),
                              (warm_start, algorithm.warm_start, "--warm-start"),
                              (not fit_intercept, algorithm.no_intercept, "--no-intercept"),
                              (noise == "secure", algorithm.secure_noise, "--noise secure")):
        if asked and not able:
            why.append(f"it takes no {what}")
    return why


def choose(model: str, given=(), *, num_examples: int | None = None,
           rows_hint: int | None = None, sparse: bool = False, user_level: bool = False,
           checkpoint: bool = False, warm_start: bool = False, fit_intercept: bool = True,
           noise: str | None = None) -> Choice:
    """The algorithm for ``--algorithm auto`` (see the module docstring). ``given``: the names of
    the algorithm options the user set (not their values, and not the defaults)."""
    if rows_hint is not None and not (isinstance(rows_hint, int) and not isinstance(rows_hint, bool)
                                      and rows_hint >= 1):
        raise ValueError("--rows-hint must be a whole number, at least 1")
    if rows_hint is not None and num_examples is not None:
        # --num-examples is the size the accounting uses; a hint beside it would be ignored
        raise ValueError("--rows-hint and --num-examples: give one (--num-examples is the public "
                         "size the accounting uses; --rows-hint only guides auto)")
    rows, source = ((num_examples, "--num-examples") if num_examples is not None else
                    (rows_hint, "--rows-hint") if rows_hint is not None else (None, None))
    given = list(given)
    shape = dict(sparse=sparse, user_level=user_level, checkpoint=checkpoint,
                 warm_start=warm_start, fit_intercept=fit_intercept, noise=noise)
    refusals = {name: _refusals(registry.get(name), model, given, **shape) for name in CANDIDATES}
    large = rows is not None and rows >= FULL_PASS_ROWS
    if large and user_level:
        # dpsgd's user-level steps cannot read only their batch: each job reads and groups the
        # whole input by user (gradient_step.UserGradientStep), and its many more steps mean more
        # jobs, so the reason to leave dpgd at this size does not hold.
        order = CANDIDATES
        why = (f"{WHY_DPGD}; kept at {rows:,} rows ({source}) with --privacy-unit-column: "
               "dpsgd's user-level steps read and group all the data once per job, not only "
               "their batch")
    elif large and model not in REGRESSION_MODELS:
        order = ("dpsgd", "dpgd")
        why = (f"{rows:,} rows ({source}), at least {FULL_PASS_ROWS:,}: a full pass per step "
               "(dpgd) is too slow there, and dpsgd matched dpgd on the classification tables "
               "measured")
    elif large:
        order = CANDIDATES
        why = (f"{WHY_DPGD}; kept at {rows:,} rows ({source}) for --model {model}: dpsgd with "
               "its defaults was behind on regression (R^2 0.912 and 0.775 against 0.952 and "
               "0.777)")
    elif rows is not None:
        order = CANDIDATES
        why = (f"{WHY_DPGD}; {rows:,} rows ({source}) are below {FULL_PASS_ROWS:,}, where a "
               "full pass per step is affordable")
    else:
        order = CANDIDATES
        why = (f"{WHY_DPGD}; no size declared (--num-examples or --rows-hint), so a full pass "
               "per step is assumed affordable (up to a few million rows)")
    for name in order:
        if not refusals[name]:
            if name != order[0]:
                why = (f"the request needs it ({order[0]}: {'; '.join(refusals[order[0]])}); "
                       f"otherwise {order[0]}: {why}")
            return Choice(name, why, rows, source)
    raise ValueError("--algorithm auto chooses between " + " and ".join(CANDIDATES) + ", and "
                     "neither serves this request: " + "; ".join(
                         f"{name}: {', '.join(refusals[name])}" for name in CANDIDATES)
                     + " (choose an algorithm with --algorithm; `beam-dp algorithms` lists them)")
