"""beam-dp: differentially private training of linear and generalized linear models on Apache Beam.

    import beam_dp
    model = beam_dp.train(X, y, model="logistic", epsilon=1.0)   # or input="data/*.parquet"

    model = beam_dp.tune(X, y, epsilon=1.0)   # private hyperparameter selection (beam_dp.tuning)

scikit-learn estimators: ``beam_dp.estimators`` (needs scikit-learn).
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

__all__ = ["Model", "PrivacyWarning", "train", "tune", "__version__"]

if TYPE_CHECKING:   # (what static readers see: the API reference, type checkers)
    from beam_dp.api import PrivacyWarning, train
    from beam_dp.model import Model
    from beam_dp.tuning import tune

# The public names are imported when first used (PEP 562), not with the package: a command that
# needs no training (`beam-dp latest-model`, `ledger`, `--help`) and Beam's workers, which import
# beam_dp's modules, skip the API's imports (dp_accounting's scipy alone takes ~1.5 s).
_PUBLIC = {"Model": "beam_dp.model", "PrivacyWarning": "beam_dp.api", "train": "beam_dp.api",
           "tune": "beam_dp.tuning"}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'beam_dp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
