"""Dataflow Flex Template entry point (deploy/dataflow): one launch = `beam-dp train --max-jobs 1`.

A Flex Template launcher runs this file with --template_location: Beam writes the job there,
and Dataflow runs it only after this process has exited. A training run needs several Beam jobs,
so the loop over jobs belongs to the orchestrator: each launch with the same parameters resumes
from ``checkpoint_dir`` (a gs:// path that outlives the launcher VM), replays the driver over the
results the earlier launches' jobs left there (beam_dp.beam.job_results), writes the next job
and exits 0 with "launch_again" in ``status_file``. The orchestrator waits for that job, then
launches again, until ``status_file`` says ``"finished": true``. The budget ledger makes a
repeated launch safe: a run whose release id is already committed writes its stored output
again and charges nothing. tests/test_flex_template.py plays the launcher and the service.

The template's own parameters are listed in deploy/dataflow/metadata.json; every other flag the
launcher passes (--project, --region, --temp_location, --sdk_container_image, ...) goes on to
Beam through `beam-dp train`, which hands flags it does not know to PipelineOptions.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys

from beam_dp import cli

NOT_FINISHED = 75   # beam-dp train: --max-jobs reached, run the same command again


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="Parquet/CSV glob(s), comma-separated")
    p.add_argument("--output", required=True, help="output directory (gs://)")
    p.add_argument("--checkpoint_dir", required=True, help="gs:// directory kept between launches")
    p.add_argument("--epsilon", default=None,
                   help="target epsilon of the run (or --noise-multiplier in train_args)")
    p.add_argument("--delta", default=None, help="target delta")
    p.add_argument("--ledger", default=None, help="postgresql://... URL of the budget ledger")
    p.add_argument("--ledger_secret", default=None,
                   help="Secret Manager version holding the ledger URL (keeps a password out of "
                        "the job's parameters): projects/P/secrets/S/versions/V")
    p.add_argument("--dataset_id", default=None, help="the ledger's dataset id")
    p.add_argument("--partition", default=None, help="comma-separated partitions the run reads")
    p.add_argument("--orchestrator_id", default=None, help="comma-separated KEY=VALUE pairs")
    p.add_argument("--algorithm", default=None, help="beam-dp train --algorithm")
    p.add_argument("--label_column", default=None, help="beam-dp train --label-column")
    p.add_argument("--warm_start", default=None, help="a previous run's output directory")
    p.add_argument("--train_args", default="", help="more `beam-dp train` flags, shell-quoted")
    p.add_argument("--status_file", default=None,
                   help="gs:// JSON file this launch writes its outcome to")
    return p


def _secret(version_name: str) -> str:
    from google.cloud import secretmanager   # in apache-beam[gcp], which the image installs
    client = secretmanager.SecretManagerServiceClient()
    return client.access_secret_version(name=version_name).payload.data.decode().strip()


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def train_argv(argv: list[str]) -> list[str]:
    """The `beam-dp train` argument list for one launch (without resolving --ledger_secret)."""
    params, beam_args = _parser().parse_known_args(argv)
    args = ["train", "--input", *_split(params.input), "--output", params.output, "--overwrite",
            "--checkpoint-dir", params.checkpoint_dir, "--max-jobs", "1"]
    optional = {"--epsilon": params.epsilon, "--delta": params.delta, "--ledger": params.ledger,
                "--dataset-id": params.dataset_id, "--algorithm": params.algorithm,
                "--label-column": params.label_column, "--warm-start": params.warm_start}
    args += [x for flag, value in optional.items() if value for x in (flag, value)]
    args += [x for p in _split(params.partition) for x in ("--partition", p)]
    args += [x for o in _split(params.orchestrator_id) for x in ("--orchestrator-id", o)]
    args += shlex.split(params.train_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in beam_args + args):
        args += ["--runner", "DataflowRunner"]
    return args + beam_args


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def _write_status(path: str, code: int) -> None:
    from apache_beam.io.filesystems import FileSystems
    status = {"exit_code": code, "finished": code == 0, "launch_again": code == NOT_FINISHED}
    with FileSystems.create(path) as f:
        f.write(json.dumps(status).encode())


def _submit_placeholder_job(beam_args: list[str]) -> None:
    """The launcher fails a launch that submits no job. The launch that finishes a run (or finds
    its release already committed) needs no Beam job, so it submits a one-element no-op job."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    with beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        _ = p | "NothingLeftToRun" >> beam.Create([None])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    params, beam_args = parser.parse_known_args(argv)
    if params.ledger and params.ledger_secret:
        parser.error("give --ledger or --ledger_secret, not both")
    args = train_argv(argv)
    if params.ledger_secret:
        args += ["--ledger", _secret(params.ledger_secret)]
    code = cli.main(args)
    if params.status_file:
        _write_status(params.status_file, code)
    if code == NOT_FINISHED:
        logging.warning("beam-dp: one Beam job written; launch the template again with the "
                        "same parameters once it has finished")
        return 0   # the launch did what a launch does: submit one job
    # The launcher has the pipeline write its job to --template_location and submits that. A
    # launch that ends the run (exit 0) wrote none: each job it needed ran after an earlier one.
    if code == 0 and _flag_value(beam_args, "--template_location"):
        runner = [] if _flag_value(beam_args, "--runner") else ["--runner=DataflowRunner"]
        _submit_placeholder_job(beam_args + runner)
    return code


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
