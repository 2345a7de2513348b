"""The one wall-clock bound tests use: a guard against hangs, not a speed goal.

A refusal that takes milliseconds on a quiet machine took 14x as long in CI beside the slow tests (0.18 s became
2.5 s), so a tight bound fails for load rather than for a defect. What a test proves about cost it proves with a
deterministic sign (peak memory, work counted, the refusal's own words); the clock only catches what would run for
minutes or forever without its guard. Speed goals live in the benchmarks under scripts/.
"""

import faulthandler

HANG_SECONDS = 30.0
# a test's two-process launch (torchrun): under a minute alone, minutes beside the slow tests on 2 cores
LAUNCH_SECONDS = 300.0


def guard_launched_rank() -> None:
    """In a launched rank: print every thread's stack on a native abort, and once more if the rank still runs half
    a minute before its test gives up on the launch, so a hang says where each rank waits (the ranks' stderr is
    the launch's, which the failing test shows)."""
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(LAUNCH_SECONDS - 30.0, exit=False)
