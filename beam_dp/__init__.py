"""beam-dp: differentially private training of linear and generalized linear models on Apache Beam.

    import beam_dp
    model = beam_dp.train(X, y, model="logistic", epsilon=1.0)   # or input="data/*.parquet"

    model = beam_dp.tune(X, y, epsilon=1.0)   # private hyperparameter selection (beam_dp.tuning)

scikit-learn estimators: ``beam_dp.estimators`` (needs scikit-learn).
"""

__version__ = "0.1.0"

from beam_dp.api import PrivacyWarning, train  # noqa: E402  (after the version)
from beam_dp.model import Model  # noqa: E402
from beam_dp.tuning import tune  # noqa: E402

__all__ = ["Model", "PrivacyWarning", "train", "tune", "__version__"]
