"""Beam entry point for training: ``python pipelines/train.py --input ... --output ... --epsilon 1``
with any Beam flags (``--runner DataflowRunner --project ... --temp_location ...
--extra_package dist/beam_dp-0.1.0-py3-none-any.whl``: see docs/guide/production.md).
Equivalent to ``beam-dp train``; everything Beam pickles lives in the installed ``beam_dp`` package."""
import sys

from beam_dp.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
