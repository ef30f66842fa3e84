"""``beam-dp latest-model ROOT --before DATE``: the newest model a daily job released before a
date (``publish.latest_before``), on any file system; what an orchestrator warm-starts from."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "latest-model",
        help="print the newest published model directory ROOT/<date>/ before a date",
        description="Prints ROOT/<date> for the greatest date (YYYY-MM-DD) before --before whose "
                    "directory holds a published model; prints nothing if there is none. ROOT "
                    "may be local, gs:// or s3://.")
    p.add_argument("root", help="the directory holding one output directory per date")
    p.add_argument("--before", required=True, help="a date, YYYY-MM-DD")
    return p


def run(args) -> int:
    from beam_dp import publish

    found = publish.latest_before(args.root, args.before)
    if found:
        print(found)
    return 0
