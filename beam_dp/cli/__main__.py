"""``python -m beam_dp.cli ...``, as the console script."""
from beam_dp.cli import console_main

console_main()
