"""Beam entry point for private dataset statistics: ``python pipelines/private_stats.py --input ...
--output ... --epsilon 1`` with any Beam flags. Equivalent to ``beam-dp stats``."""
import sys

from beam_dp.cli import main

if __name__ == "__main__":
    sys.exit(main(["stats", *sys.argv[1:]]))
