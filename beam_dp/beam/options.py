"""beam-dp's own Beam flags: given among Beam's (PipelineOptions, so that they pass through as
Beam's do and ``beam-dp train --help`` stays short). Importing this module registers them."""
from __future__ import annotations

from apache_beam.options.pipeline_options import PipelineOptions


class StepSumOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument(
            "--step_sums", choices=("auto", "driver", "workers"), default="auto",
            help="who sums each step of DP-SGD's sampled batches: the driver, reading the batch "
                 "files, or the workers, in step jobs that send the driver only the model; auto "
                 "chooses from the runner and the expected batch (beam_dp.step_costs)")
