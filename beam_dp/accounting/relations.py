"""The neighbouring relations this library accounts under, by the names its callers use
(``ADD_REMOVE``, ``REPLACE_ONE``, ``USER_ADD_REMOVE``), and dp_accounting's relation for each."""
from __future__ import annotations

import dp_accounting


ACCOUNTANTS = ("pld", "rdp")
ADD_REMOVE = "add/remove"
REPLACE_ONE = "replace-one"
# User-level privacy (--privacy-unit-column, ``beam_dp.user_level``): the unit added or removed
# is a user with all their rows. dp_accounting's relation is the same add/remove one unit: the
# contribution bounding makes each release's sensitivity to a user what it was to a row.
USER_ADD_REMOVE = "add/remove one user (all their rows)"

_RELATIONS = {
    ADD_REMOVE: dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    REPLACE_ONE: dp_accounting.NeighboringRelation.REPLACE_ONE,
    USER_ADD_REMOVE: dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
}


def _relation_name(relation) -> str:
    return next(name for name, r in _RELATIONS.items() if r == relation)
