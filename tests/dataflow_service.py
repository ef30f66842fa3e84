"""Test-only: plays the Dataflow service for the Flex Template tests (tests/test_flex_template.py).

Run as a process of its own, it reads one ``--template_location`` path per line on stdin, runs
the job written there and answers a line (``ran`` or ``failed: ...``). Beam's DataflowRunner
writes a template as the job's JSON, which names the pipeline proto it staged
(``pipelineUrl``); that proto is the job Dataflow would run. Here it runs on Beam's in-process
runner (FnApiRunner), its environments switched from Dataflow's SDK container to this Python:
the same transforms, the same pickled functions, the same reads and writes through the file
systems, in another process than the launch that built it, after that launch has exited.
"""
from __future__ import annotations

import json
import sys
import traceback


def run_template(location: str) -> None:
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.portability import python_urns
    from apache_beam.portability.api import beam_runner_api_pb2
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    with FileSystems.open(location) as f:
        job = json.loads(f.read())
    options = job["environment"]["sdkPipelineOptions"]["options"]
    pipeline = beam_runner_api_pb2.Pipeline()
    with FileSystems.open(options["pipelineUrl"]) as f:
        pipeline.ParseFromString(f.read())
    for environment in pipeline.components.environments.values():
        environment.urn, environment.payload = python_urns.EMBEDDED_PYTHON, b""
    FnApiRunner().run_via_runner_api(pipeline, PipelineOptions([])).wait_until_finish()


def main() -> None:
    for line in sys.stdin:
        try:
            run_template(line.strip())
            print("ran", flush=True)
        except Exception as e:   # told to the test, which shows it
            print(f"failed: {e!r} {traceback.format_exc()!r}", flush=True)


if __name__ == "__main__":
    main()
