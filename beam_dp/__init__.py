"""beam-dp: differentially private training of linear and generalized linear models on Apache Beam."""

__version__ = "0.1.0"
