"""Ctrl-C that Dagster captures at the end of a run (outside any step, where it does not
interrupt) and then forgets: the build notices it and stops instead of going on to its next run."""

from __future__ import annotations

import logging
import signal
import threading

import dagster as dg
import pytest

from aml_pipeline.runner.build import _execute
from aml_pipeline.runner.interrupts import interrupts_not_lost


class _SigintAtRunEnd(logging.Handler):
    """Raises SIGINT in this process as Dagster logs the run's success: after the last step,
    while Dagster's own handler only records the signal."""

    def emit(self, record: logging.LogRecord) -> None:
        if "RUN_SUCCESS" in record.getMessage():
            signal.raise_signal(signal.SIGINT)


@dg.logger
def sigint_at_run_end(_context):  # noqa: ANN001 - Dagster passes the logger's init context
    log = logging.getLogger("aml_pipeline_tests.sigint_at_run_end")
    log.setLevel(logging.DEBUG)
    log.handlers = [_SigintAtRunEnd()]
    log.propagate = False
    return log


@dg.op
def work() -> int:
    return 1


@dg.job(logger_defs={"sigint": sigint_at_run_end})
def interrupted_at_its_end():
    work()


RUN_CONFIG = {"loggers": {"sigint": {}}}


def test_dagster_forgets_a_sigint_at_the_end_of_a_run():
    """What the guard is for: the same run without it ends as a success, the Ctrl-C gone."""
    result = interrupted_at_its_end.execute_in_process(run_config=RUN_CONFIG)
    assert result.success
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Dagster restored it


def test_a_build_run_that_swallowed_a_sigint_raises_keyboard_interrupt():
    with dg.DagsterInstance.ephemeral() as instance:
        with pytest.raises(KeyboardInterrupt):
            _execute(interrupted_at_its_end, instance, RUN_CONFIG)
        # the run itself finished: the interrupt stops what would come after it
        [record] = instance.get_run_records()
        assert record.dagster_run.status == dg.DagsterRunStatus.SUCCESS
        assert signal.set_wakeup_fd(-1) == -1  # the wake-up descriptor is given back


def test_the_guard_passes_quiet_blocks_and_other_signals_and_is_a_no_op_off_the_main_thread():
    with interrupts_not_lost():
        pass
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        with interrupts_not_lost():
            signal.raise_signal(signal.SIGUSR1)  # another signal with a Python handler: not Ctrl-C
    finally:
        signal.signal(signal.SIGUSR1, previous)
    raised: list[BaseException] = []

    def off_main() -> None:
        try:
            with interrupts_not_lost():
                pass
        except BaseException as e:  # noqa: BLE001 - any escape is the failure
            raised.append(e)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert raised == []
