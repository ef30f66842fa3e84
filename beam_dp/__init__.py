"""beam-dp: differentially private training of linear and generalized linear models on Apache Beam.

    import beam_dp
    model = beam_dp.train(X, y, model="logistic", epsilon=1.0)   # or input="data/*.parquet"

scikit-learn estimators: ``beam_dp.estimators`` (needs scikit-learn).
"""

__version__ = "0.1.0"

from beam_dp.api import Model, PrivacyWarning, train  # noqa: E402  (after the version)

__all__ = ["Model", "PrivacyWarning", "train", "__version__"]
