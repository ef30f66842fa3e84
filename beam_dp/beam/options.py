"""beam-dp's own Beam flags: given among Beam's (PipelineOptions, so that they pass through as
Beam's do and ``beam-dp train --help`` stays short). Importing this module registers them."""
from __future__ import annotations

from apache_beam.options.pipeline_options import PipelineOptions


STEP_SUMS = ("auto", "driver", "workers")


class StepSumOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):
        # (no ``choices``: Beam's parser would answer a wrong value with its whole usage, 200
        # lines; ``step_sums`` refuses it in one)
        parser.add_argument(
            "--step_sums", default="auto",
            help="who sums each step of DP-SGD's sampled batches: the driver, reading the batch "
                 "files, or the workers, in step jobs that send the driver only the model; auto "
                 "chooses from the runner and the expected batch (beam_dp.step_costs)")


def step_sums(options: PipelineOptions) -> str:
    """--step_sums, checked."""
    given = options.view_as(StepSumOptions).step_sums
    if given not in STEP_SUMS:
        raise ValueError(f"--step_sums must be one of {', '.join(STEP_SUMS)}, got {given!r}")
    return given
