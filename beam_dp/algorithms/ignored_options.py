"""Options that act only sometimes: one given where it has no effect is refused, not dropped.

A user who passes an option believes it acted; ``refuse_ignored`` checks a run request
(``Request``) against ``ACTS_ONLY_WHEN`` before any data is read (``beam_dp.train``, the audit
and ``beam_dp.tune`` call it).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from beam_dp import preconditioning
from beam_dp.algorithms.spec import Privacy, flag


@dataclasses.dataclass(frozen=True)
class Request:
    """What a run request says before any data is read, for ``refuse_ignored``: the model, the
    privacy request, the algorithm's options (None: a run with no algorithm options to check),
    ``given`` (``beam_dp.train``'s own keywords, None where not given) and the declared input."""

    model: str
    privacy: Privacy
    options: object = None
    given: dict = dataclasses.field(default_factory=dict)
    categorical_columns: tuple = ()
    hash_buckets: int | None = None
    imputed: bool = False        # a column's missing-value policy is median or mean
    warm_start: bool = False

    def value(self, name: str):
        """The option's value as given (None: not given, or not an option of this run)."""
        if name in self.given:
            return self.given[name]
        return getattr(self.options, name, None)


def _scale_releases(r: Request) -> bool:
    """Whether the column scaling may release anything with --scale-epsilon's budget
    (``column_scaling.prepare``): private ranges (private, or auto but for the maps that turn
    auto off) or median/mean fills."""
    choice = r.value("scale_features")
    return r.imputed or choice == "private" or (
        choice == "auto" and not r.value("feature_norm") and not r.warm_start)


def _preconditions(r: Request) -> bool:
    return preconditioning.preconditions(r.value("precondition"), bool(r.categorical_columns),
                                         r.privacy.epsilon)


@dataclasses.dataclass(frozen=True)
class ActsOnlyWhen:
    """Option ``name`` (a keyword of ``beam_dp.train``; its flag ``flag(name)``) has an effect
    only where ``acts(request)``; given elsewhere, it is refused with ``why``."""

    name: str
    acts: Callable[[Request], bool]
    why: str


# Options a run would otherwise accept and silently drop: a user who passes one believes it
# acted, so it is refused, not dropped. Every option here defaults to None ("not given"), so a
# value equal to the default is refused too. An option missing from a run's algorithm is its
# options dataclass's business (make_options refuses an unknown name).
ACTS_ONLY_WHEN: tuple[ActsOnlyWhen, ...] = (
    ActsOnlyWhen("huber_delta", lambda r: r.model == "huber",
                 "it is the threshold of --model huber's loss, and the model is another"),
    ActsOnlyWhen("num_classes", lambda r: r.model == "softmax",
                 "only --model softmax has a class count (the other models have one output)"),
    ActsOnlyWhen("hash_seed", lambda r: bool(r.categorical_columns) and r.hash_buckets is not None,
                 "it seeds the hash of --categorical-columns with --hash-buckets, and no column "
                 "is hashed"),
    ActsOnlyWhen("count_epsilon", lambda r: r.privacy.num_examples is None,
                 "with --num-examples n is public and no count is released"),
    ActsOnlyWhen("scale_epsilon", _scale_releases,
                 "it is the budget of the private column ranges (--scale-features private or "
                 "auto) and of median/mean fills, and none is released (--scale-features none, or "
                 "auto with --feature-norm or --warm-start, which turn it off)"),
    ActsOnlyWhen("precondition_epsilon", _preconditions,
                 "it is the budget of --precondition counts' column counts, released only with "
                 "--categorical-columns and --precondition counts (or auto with --epsilon)"),
    ActsOnlyWhen("adaptive_clip_rate", lambda r: r.value("adaptive_clip_quantile") is not None,
                 "it is adaptive clipping's update rate, and adaptive clipping is off without "
                 "--adaptive-clip-quantile"),
)


def refuse_ignored(request: Request) -> None:
    """Refuses (ValueError naming the flag and why) an option given where it has no effect
    (``ACTS_ONLY_WHEN``): called by ``beam_dp.train``, the audit and ``beam_dp.tune`` before any
    data is read."""
    for row in ACTS_ONLY_WHEN:
        if request.value(row.name) is not None and not row.acts(request):
            raise ValueError(f"{flag(row.name)} has no effect here: {row.why}; drop it")
