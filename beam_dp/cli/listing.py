"""``beam-dp algorithms``: every registered algorithm, when to use it, and its flags."""
from __future__ import annotations


def add_parser(sub):
    return sub.add_parser("algorithms", help="list the algorithms, when to use each, and their flags")


def run(args) -> int:
    from beam_dp.algorithms import registry, spec

    for algorithm in registry.algorithms().values():
        print(f"{algorithm.name}: {algorithm.use_when}")
        print(f"  models: {', '.join(algorithm.models)}; guarantee for {algorithm.relation} "
              f"neighbouring datasets")
        for flag, default, text in spec.describe(algorithm.options):
            print(f"  {flag:<26} {text.replace('%%', '%')} (default: {default})")
        print()
    return 0
